"""An exported segment as the arrays a trainer trains on
(docs/training.md#the-export-document-schema_version-3).

A segment is one token sequence: ``token_ids``, ``loss_mask`` (1 exactly
where the model sampled), ``logprobs`` (the sampled tokens', 0.0 elsewhere),
``prompt_length`` (the tokens before the first sampled one), and per turn
the policy version of every sampled token (``weight_versions`` spans).
`SegmentTokens` splits it into the prompt and the response the way every
trainer does, `segment_steps` into one record per turn (the steps view's,
for step-wise trainers), and the module reads the routed experts and a
rescore.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "SegmentTokens",
    "StepTokens",
    "experts_top_k",
    "rescore_logprobs",
    "routed_experts",
    "segment_steps",
    "step_range",
    "version_step",
]


@dataclass(frozen=True, slots=True)
class SegmentTokens:
    prompt_ids: list[int]
    response_ids: list[int]
    # 1 where the model sampled the token, 0 for what was appended (tool
    # results, user messages, the template's tokens between turns).
    response_mask: list[int]
    # The sampled token's logprob; 0.0 where the mask is 0.
    response_logprobs: list[float]
    # The policy version that sampled each response token; None where the
    # mask is 0.
    response_versions: list[str | None]
    # Turns of the segment, and its finish: the last turn's finish reason.
    num_turns: int
    finish_reason: str | None

    @classmethod
    def of(cls, segment: Mapping[str, Any]) -> SegmentTokens:
        ids: list[int] = segment["token_ids"]
        start = int(segment["prompt_length"])
        turns = segment.get("turns") or ()
        return cls(
            prompt_ids=ids[:start],
            response_ids=ids[start:],
            response_mask=segment["loss_mask"][start:],
            response_logprobs=segment["logprobs"][start:],
            response_versions=_versions(turns, start, len(ids)),
            num_turns=len(turns),
            finish_reason=turns[-1]["finish_reason"] if turns else None,
        )

    @property
    def sampled(self) -> int:
        """How many tokens the model sampled."""
        return sum(self.response_mask)


@dataclass(frozen=True, slots=True)
class StepTokens:
    """One turn of a segment as a step-wise trainer's record (the steps
    view's, docs/training.md#the-steps-view-skyrl-rllm-step-wise): everything
    the model read before it sampled, and what it sampled."""

    # Where the turn is: its segment's and its own index.
    segment: int
    turn: int
    # The segment's ids up to the turn's ``completion_start``.
    prompt_ids: list[int]
    # The turn's sampled ids, their mask (all 1: ``loss_mask`` over the
    # span), their logprobs and the policy version of each.
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    response_versions: list[str | None]
    finish_reason: str | None
    # Requests after the first (interrupted and continued: `turns[].continuations`).
    continuations: int

    @property
    def end(self) -> int:
        """The turn's ``completion_end``: its length in the segment."""
        return len(self.prompt_ids) + len(self.response_ids)


def segment_steps(segment: Mapping[str, Any]) -> list[StepTokens]:
    """Every turn of the segment, in order (needs the export's ``turns``)."""
    if "turns" not in segment:
        raise ValueError(
            f"segment {segment.get('index')} has no turns: collect with include=turns "
            "(the default) to split it into steps"
        )
    ids: list[int] = segment["token_ids"]
    steps = []
    for turn in segment["turns"]:
        start, end = int(turn["completion_start"]), int(turn["completion_end"])
        steps.append(
            StepTokens(
                segment=int(segment["index"]),
                turn=int(turn["index"]),
                prompt_ids=ids[:start],
                response_ids=ids[start:end],
                response_mask=segment["loss_mask"][start:end],
                response_logprobs=segment["logprobs"][start:end],
                response_versions=_versions((turn,), start, end),
                finish_reason=turn["finish_reason"],
                continuations=len(turn.get("continuations") or ()),
            )
        )
    return steps


def _versions(turns: Sequence[Mapping[str, Any]], start: int, end: int) -> list[str | None]:
    """The policy version of each position in ``[start, end)`` from the
    turns' ``weight_versions`` spans; None where no span covers it."""
    versions: list[str | None] = [None] * (end - start)
    for turn in turns:
        for span in turn.get("weight_versions") or ():
            first, last = max(span["start"], start) - start, min(span["end"], end) - start
            if last > first:
                versions[first:last] = [span["version"]] * (last - first)
    return versions


def routed_experts(segment: Mapping[str, Any], top_k: int) -> np.ndarray | None:
    """The segment's routed experts as ``(positions, layers, top_k)``
    (``--routed-experts``: one row per position of ``token_ids`` the
    engine reported, layer by layer); None when the export has none."""
    experts = segment.get("routed_experts")
    if not experts:
        return None
    positions, width = experts["shape"]
    if width % top_k:
        raise ValueError(
            f"routed experts have {width} values per position, not a multiple of top_k {top_k}"
        )
    flat = np.frombuffer(base64.b64decode(experts["data"]), dtype=np.dtype(experts["dtype"]))
    return flat.reshape(positions, width // top_k, top_k)


@functools.cache
def experts_top_k(model_path: str) -> int:
    """The model's routed experts per token (its config's
    ``num_experts_per_tok``): what splits an export's routed-experts rows
    (``layers × top_k`` values per position) into layers."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        raise TypeError(
            f"{model_path}: no num_experts_per_tok in its config; give the adapter experts_top_k"
        )
    return top_k


def rescore_logprobs(segment: Mapping[str, Any], label: str) -> list[float | None] | None:
    """The rescore `label`'s logprob at every position of the segment (None
    where it scored none); None when the segment has no such rescore."""
    rescore = (segment.get("rescores") or {}).get(label)
    if rescore is None:
        return None
    scores: list[float | None] = rescore["logprobs"]
    return scores


def version_step(version: str | None) -> int | None:
    """A policy version as a trainer's step: the decimal integer the
    trainer named it with on resume (``POST /admin/resume
    {"weight_version": "12"}``), None for any other label (a worker's own,
    such as ``"default"``)."""
    if version is None:
        return None
    text = version.strip()
    return int(text) if text.isdecimal() else None


def step_range(
    versions: Sequence[str | None], unnamed: int | None = None
) -> tuple[int, int] | None:
    """The least and greatest step of the sampled tokens' `versions` (None:
    a token not sampled); a version that names no step counts as `unnamed`
    (None: left out). None when no step is known."""
    # Per distinct version: a segment's tokens carry a handful.
    steps = [
        unnamed if (step := version_step(v)) is None else step
        for v in set(versions)
        if v is not None
    ]
    known = [s for s in steps if s is not None]
    return (min(known), max(known)) if known else None
