"""An episode's export as verl's ``AgentLoopOutput``s (docs/trainers.md#verl).

Field by field, per segment (`segments.SegmentTokens`):

- ``prompt_ids``: the tokens before the first sampled one; longer than
  ``rollout.prompt_length``, left-truncated as verl's own loops do
  (``AgentLoopBase._cap_text_prompt_length``);
- ``response_ids``, ``response_mask``, ``response_logprobs``: everything
  after, capped at ``rollout.response_length`` as verl's loops cap
  (``response_ids[:response_length]``): what a cap drops is not trained on,
  and ``extra_fields["rollout_session"]`` says how much;
- ``routed_experts``: ``(positions, layers, top_k)`` over prompt + response
  positions, the rows the engine reported (verl pads the rest);
- ``reward_score``: the agent's reward on the episode's main segment (the
  last); verl copies it to the others (v1) or scores with its reward loop
  when the agent returned None;
- ``num_turns``: the segment's messages (user, assistant, tool), as verl
  counts them; ``metrics.num_preempted``: requests its turns were
  continued with after an abort;
- ``extra_fields``: ``min_global_steps`` / ``max_global_steps`` from the
  sampled tokens' policy versions (a version is a step when it is a
  decimal integer: `segments.version_step`; a worker's own label such as
  ``"default"`` counts as the batch's ``global_steps`` where the row has
  it, v1's; else they are None), the teacher's
  ``teacher_ids`` / ``teacher_logprobs`` (top-1: the sequence's own ids),
  ``reward_extra_info`` (``{}`` when the agent scored), and
  ``rollout_session`` (session id, segment, turns, truncation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..episode import Episode, EpisodeFailed
from ..segments import SegmentTokens, rescore_logprobs, routed_experts, step_range

__all__ = ["Limits", "verl_outputs"]

logger = logging.getLogger("rollout_session.trainers")


@dataclass(frozen=True, slots=True)
class Limits:
    """What verl's rollout config caps and asks for."""

    prompt_length: int
    response_length: int
    # Every segment (v1), or the last one (the legacy trainer: one output).
    every_segment: bool
    # Routed experts per layer (the model's ``num_experts_per_tok``); None
    # when the export carries none.
    experts_top_k: int | None = None
    # The teacher's rescore label, when one scored the session.
    teacher: str | None = None
    # The batch's step: what a token sampled under a worker's own label
    # counts as.
    global_steps: int | None = None


def verl_outputs(
    episode: Episode, limits: Limits, make: Callable[..., Any], metrics: Callable[..., Any]
) -> list[Any]:
    """The episode's outputs, main segment last (`make`: verl's
    ``AgentLoopOutput``; `metrics`: its ``AgentLoopMetrics``)."""
    segments = [s for s in episode.document["segments"] if any(s["loss_mask"])]
    if not segments:
        raise EpisodeFailed(
            f"session {episode.session_id}: the agent's episode sampled no token "
            "(nothing to train on)"
        )
    count = len(segments)
    dropped: list[dict[str, Any]] = []
    dropped_sampled = 0
    if not limits.every_segment and count > 1:
        # Said, and counted in the output (`extra_fields["rollout_session"]`
        # ``segments_dropped`` / ``sampled_tokens_dropped``): never silent.
        dropped, segments = segments[:-1], segments[-1:]
        dropped_sampled = sum(sum(s["loss_mask"]) for s in dropped)
        logger.warning(
            "session %s: %d segments with sampled tokens (the agent rewrote its history); "
            "verl's legacy trainer takes one output per run: %d sampled tokens of the "
            "earlier segments are not trained on (trainer.use_v1 trains on every segment)",
            episode.session_id,
            count,
            dropped_sampled,
        )
    last = len(segments) - 1
    return [
        _output(
            episode,
            segment,
            limits,
            make,
            metrics,
            main=i == last,
            count=count,
            dropped=(len(dropped), dropped_sampled),
        )
        for i, segment in enumerate(segments)
    ]


def _output(
    episode: Episode,
    segment: dict[str, Any],
    limits: Limits,
    make: Callable[..., Any],
    metrics: Callable[..., Any],
    *,
    main: bool,
    count: int,
    dropped: tuple[int, int],  # segments not output, and their sampled tokens
) -> Any:
    tokens = SegmentTokens.of(segment)
    cut = max(0, len(tokens.prompt_ids) - limits.prompt_length)  # left-truncated prompt ids
    prompt = tokens.prompt_ids[cut:]
    keep = limits.response_length
    response = tokens.response_ids[:keep]
    # A token under no step's name (a worker's own label, before the
    # weight-sync hook's first resume) counts as the batch's step where the
    # row says it (v1); else it is unknown: None, never a guess.
    steps = step_range(tokens.response_versions[:keep], limits.global_steps) or (None, None)
    continuations = sum(len(t.get("continuations") or ()) for t in segment.get("turns") or ())
    extra: dict[str, Any] = {
        "min_global_steps": steps[0],
        "max_global_steps": steps[1],
        "rollout_session": {
            "session_id": episode.session_id,
            "segment": segment["index"],
            "segments": count,
            "segments_dropped": dropped[0],
            "sampled_tokens_dropped": dropped[1],
            "turns": tokens.num_turns,
            "continuations": continuations,
            "prompt_tokens_dropped": cut,
            "response_tokens_dropped": len(tokens.response_ids) - len(response),
        },
    }
    reward = episode.reward if main else None
    if episode.reward is not None:
        extra["reward_extra_info"] = {}
    if limits.teacher is not None:
        extra.update(_teacher(segment, limits.teacher, cut, len(prompt) + len(response)))
    if cut or len(response) < len(tokens.response_ids):
        logger.warning(
            "session %s segment %d: %d prompt and %d response tokens over verl's "
            "prompt_length %d / response_length %d are not trained on",
            episode.session_id,
            segment["index"],
            cut,
            len(tokens.response_ids) - len(response),
            limits.prompt_length,
            limits.response_length,
        )
    experts = None
    if limits.experts_top_k is not None:
        rows = routed_experts(segment, limits.experts_top_k)
        if rows is not None:
            experts = rows[cut : cut + len(prompt) + len(response)]
    messages = segment.get("messages")
    return make(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=tokens.response_mask[:keep],
        response_logprobs=tokens.response_logprobs[:keep],
        routed_experts=experts,
        reward_score=reward,
        num_turns=len(messages) if messages is not None else 2 * tokens.num_turns,
        metrics=metrics(num_preempted=continuations),
        extra_fields=extra,
    )


def _teacher(segment: dict[str, Any], label: str, cut: int, length: int) -> dict[str, Any]:
    """verl's teacher fields from the rescore `label`: per position of the
    (capped) sequence, ``(length, 1)`` ids and logprobs (top-1: the
    sequence's own ids; position 0, scored by nothing, 0.0)."""
    import torch

    scores = rescore_logprobs(segment, label)
    if scores is None:
        raise EpisodeFailed(f"segment {segment['index']} has no rescore {label!r}")
    ids = segment["token_ids"][cut : cut + length]
    logprobs = [0.0 if s is None else float(s) for s in scores[cut : cut + length]]
    return {
        "teacher_ids": torch.tensor(ids, dtype=torch.int32).unsqueeze(1),
        "teacher_logprobs": torch.tensor(logprobs, dtype=torch.float32).unsqueeze(1),
    }
