"""An episode's export as SkyRL's rows, and a batch of them as SkyRL's
``GeneratorOutput`` (docs/trainers.md#skyrl).

SkyRL 0.4.0 trains in one of two shapes (``skyrl/train/generators/base.py``
``GeneratorOutput``; checked by ``skyrl/train/utils/trainer_utils.py``
``validate_generator_output``):

- **trajectory rows** (the default): exactly one row per prompt. An
  episode's one segment is its row: ``prompt_token_ids`` the tokens before
  the first sampled one, ``response_ids`` everything after, ``loss_masks``
  1 exactly where the model sampled, ``rollout_logprobs`` the sampled
  tokens' (0.0 elsewhere). An episode whose agent rewrote its history (two
  or more segments that sampled) has no exact single row: concatenating
  the segments would train the later ones on a context the model never
  read, and the last segment alone would drop what the others sampled. It
  is refused (`EpisodeFailed`, handled as the generator's ``on_error``
  says), naming the fix: step-wise training, where every segment's turns
  are rows;
- **step-wise rows** (``generator.step_wise_trajectories``): one row per
  turn, segment by segment (the export's steps view): the prompt is
  everything the model read before the turn, the response what it sampled;
  ``is_last_step`` marks the episode's last turn, which carries the reward
  (SkyRL propagates the last step's advantage to the earlier ones). With
  ``generator.merge_stepwise_output`` SkyRL merges a segment's turns back
  into one row, the segment's own.

Every row: the agent's reward (the last step's, in step-wise rows; 0.0 on
the others), the finish reason as SkyRL's stop reason (`stop_reason`), and
with R3 the routed experts in SkyRL's ``RoutedExpertIndices`` layout
(``[tokens, layers, top_k]``, a prefix of the row's positions: row t routes
the forward pass that reads token t), compacted by SkyRL's own
``compact_routed_expert_indices``. A row that trains nothing (an episode
the generator masks) is a placeholder: one token of prompt and response,
loss mask 0, reward 0.0, stop reason ``"error"``, and with R3 a one-row
dummy route (``validate_generator_output`` allows a short route on a row
that trains nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from ..episode import Episode, EpisodeFailed
from ..segments import SegmentTokens, routed_experts, segment_steps, step_range

__all__ = [
    "EpisodeRows",
    "Row",
    "generator_output",
    "placeholder_row",
    "step_rows",
    "stop_reason",
    "trajectory_row",
]

logger = logging.getLogger("rollout_session.trainers")

# The session's finish reasons as SkyRL's stop reasons: SkyRL compares with
# "stop" (``zero_reward_on_non_stop``) and "length" (overlong filtering), as
# vLLM reports them; "tool_calls" is the chat route's name for a "stop"
# that parsed into calls (vLLM's token route says "stop").
_STOP_REASONS: Final = {"stop": "stop", "tool_calls": "stop", "length": "length", "abort": "abort"}
# The stop reason of a row that trains nothing.
ERROR_STOP_REASON: Final = "error"

Compact = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True, slots=True)
class Row:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float
    stop_reason: str
    # ``[tokens, layers, top_k]``, or None (no R3, or a placeholder).
    routes: np.ndarray | None = None
    # The policy version of each response token (None where not sampled).
    versions: list[str | None] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EpisodeRows:
    """One prompt's rows and what the batch's metrics say of its episode."""

    rows: list[Row]
    session_id: str | None
    seconds: float
    segments: int = 0
    turns: int = 0
    continuations: int = 0
    # Why the episode is a placeholder row (None: it trains).
    masked: str | None = None


def stop_reason(finish_reason: str | None) -> str:
    """A turn's finish reason as SkyRL's stop reason (an unknown one is
    passed on as it is: SkyRL treats anything but "stop" as unfinished)."""
    if finish_reason is None:
        return ERROR_STOP_REASON
    return _STOP_REASONS.get(finish_reason, finish_reason)


def _reward(episode: Episode) -> float:
    if episode.reward is None:
        raise EpisodeFailed(
            f"session {episode.session_id}: the agent returned no reward; SkyRL trains on the "
            "rewards its generator returns (it has no reward stage of its own after it)"
        )
    return episode.reward


def _routes(
    segment: dict[str, Any], top_k: int | None, rows: int | None = None
) -> np.ndarray | None:
    if top_k is None:
        return None
    experts = routed_experts(segment, top_k)
    if experts is None:
        raise ValueError(
            f"segment {segment['index']} has no routed experts, but SkyRL replays them "
            "(generator.inference_engine.enable_return_routed_experts): start the session "
            "servers with --routed-experts"
        )
    return experts if rows is None else experts[:rows]


def _sampled(episode: Episode) -> list[dict[str, Any]]:
    segments = [s for s in episode.document["segments"] if SegmentTokens.of(s).sampled]
    if not segments:
        raise EpisodeFailed(
            f"session {episode.session_id}: the agent's episode sampled no token "
            "(nothing to train on)"
        )
    return segments


def trajectory_row(episode: Episode, top_k: int | None) -> Row:
    """The episode's one row (SkyRL's default, non-step-wise training)."""
    segments = _sampled(episode)
    if len(segments) > 1:
        raise EpisodeFailed(
            f"session {episode.session_id}: the agent rewrote its history "
            f"({len(segments)} segments sampled: {_reasons(segments)}); SkyRL takes one row per "
            "prompt and no single row holds them exactly: train step-wise "
            "(generator.step_wise_trajectories=true), where every segment's turns are rows"
        )
    (segment,) = segments
    tokens = SegmentTokens.of(segment)
    return Row(
        prompt_ids=tokens.prompt_ids,
        response_ids=tokens.response_ids,
        loss_mask=tokens.response_mask,
        logprobs=tokens.response_logprobs,
        reward=_reward(episode),
        stop_reason=stop_reason(tokens.finish_reason),
        routes=_routes(segment, top_k),
        versions=tokens.response_versions,
    )


def _reasons(segments: Sequence[dict[str, Any]]) -> str:
    branches = [s.get("branch") for s in segments[1:]]
    return ", ".join(str(b.get("reason")) if b else "?" for b in branches)


def step_rows(episode: Episode, top_k: int | None) -> list[Row]:
    """One row per turn that sampled, segment by segment; the reward on the
    last (step-wise training)."""
    reward = _reward(episode)
    rows: list[Row] = []
    for segment in episode.document["segments"]:
        for step in segment_steps(segment):
            if not step.response_ids:  # sampled nothing: no row can hold it
                continue
            rows.append(
                Row(
                    prompt_ids=step.prompt_ids,
                    response_ids=step.response_ids,
                    loss_mask=step.response_mask,
                    logprobs=step.response_logprobs,
                    reward=0.0,
                    stop_reason=stop_reason(step.finish_reason),
                    routes=_routes(segment, top_k, step.end),
                    versions=step.response_versions,
                )
            )
    if not rows:
        raise EpisodeFailed(
            f"session {episode.session_id}: the agent's episode sampled no token "
            "(nothing to train on)"
        )
    last = rows[-1]
    rows[-1] = Row(**{**{f: getattr(last, f) for f in Row.__dataclass_fields__}, "reward": reward})
    return rows


def placeholder_row(token_id: int) -> Row:
    """A row that trains nothing, for an episode the generator masks."""
    return Row(
        prompt_ids=[token_id],
        response_ids=[token_id],
        loss_mask=[0],
        logprobs=[0.0],
        reward=0.0,
        stop_reason=ERROR_STOP_REASON,
    )


def generator_output(
    episodes: Sequence[EpisodeRows],
    trajectory_ids: Sequence[Any] | None,
    *,
    step_wise: bool,
    logprobs: bool,
    routes: bool,
    compact: Compact,
) -> dict[str, Any]:
    """The batch's ``GeneratorOutput``, rows in the batch's order (an
    episode's rows together). `compact`: SkyRL's
    ``compact_routed_expert_indices``."""
    rows = [row for episode in episodes for row in episode.rows]
    owners = [i for i, episode in enumerate(episodes) for _ in episode.rows]
    ids = None
    if trajectory_ids is not None:
        ids = [trajectory_ids[i] for i in owners] if step_wise else list(trajectory_ids)
    is_last = None
    if step_wise:
        is_last = [owners[j + 1] != owners[j] for j in range(len(owners) - 1)] + [True]
    return {
        "prompt_token_ids": [row.prompt_ids for row in rows],
        "response_ids": [row.response_ids for row in rows],
        "rewards": [row.reward for row in rows],
        "loss_masks": [row.loss_mask for row in rows],
        "stop_reasons": [row.stop_reason for row in rows],
        "rollout_metrics": _metrics(episodes, rows),
        "rollout_logprobs": [row.logprobs for row in rows] if logprobs else None,
        "trajectory_ids": ids,
        "trajectory_generation_times": [episodes[i].seconds for i in owners],
        "trajectory_time_splits": None,
        "rollout_expert_indices": _expert_indices(rows, compact) if routes else None,
        "rollout_sample_support": None,
        "is_last_step": is_last,
        "env_metrics": [
            {"session_id": episodes[i].session_id, "masked": episodes[i].masked} for i in owners
        ],
    }


def _expert_indices(rows: Sequence[Row], compact: Compact) -> list[np.ndarray] | None:
    """Every row's routes; a placeholder's a one-row dummy of the batch's
    shape. None when no row has routes (nothing trains: SkyRL's check then
    lets R3 go without them)."""
    real = [compact(row.routes) for row in rows if row.routes is not None]
    if not real:
        return None
    dummy = np.zeros((1, *real[0].shape[1:]), dtype=real[0].dtype)
    found = iter(real)
    return [next(found) if row.routes is not None else dummy for row in rows]


def _metrics(episodes: Sequence[EpisodeRows], rows: Sequence[Row]) -> dict[str, Any]:
    trained = [e for e in episodes if e.masked is None]
    metrics: dict[str, Any] = {
        "rollout_session/episodes": len(episodes),
        "rollout_session/masked_episodes": len(episodes) - len(trained),
        "rollout_session/segments_per_episode": _mean([e.segments for e in trained]),
        "rollout_session/turns_per_episode": _mean([e.turns for e in trained]),
        "rollout_session/continuations": sum(e.continuations for e in trained),
    }
    steps = step_range([v for row in rows for v in row.versions])
    if steps is not None:
        metrics["rollout_session/min_weight_version"] = steps[0]
        metrics["rollout_session/max_weight_version"] = steps[1]
    return metrics


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values) if values else 0.0
