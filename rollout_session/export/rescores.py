"""A segment's rescores as the export shows them, with the drift between
each and the rollout's own logprobs (docs/training.md#rescoring).

Drift is measured over the sampled positions (mask 1) the rescore covers,
where ``r = target logprob − rollout logprob`` of the token the rollout
sampled: the mean and the largest ``|r|``, and an estimate of
KL(rollout ‖ target) from those same tokens, ``mean(exp(r) − 1 − r)``
(Schulman's "k3": unbiased for tokens drawn from the rollout policy, never
negative). The whole segment's, and each turn's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..session.rescores import Rescore
from ..session.session import Session
from ..session.trajectory import Turn
from ..tokens import LogprobArray

__all__ = ["drift", "rescore_document", "rescore_fields"]


def drift(ratio: npt.NDArray[np.float64]) -> dict[str, Any]:
    """Drift figures of log ratios (target − rollout) over sampled tokens."""
    if not len(ratio):
        return {"tokens": 0, "mean_abs": None, "max_abs": None, "approx_kl": None}
    gap = np.abs(ratio)
    return {
        "tokens": len(ratio),
        "mean_abs": float(gap.mean()),
        "max_abs": float(gap.max()),
        "approx_kl": float(np.mean(np.expm1(ratio) - ratio)),
    }


def rescore_fields(
    rescore: Rescore,
    rollout: LogprobArray,
    mask: npt.NDArray[np.uint8],
    turns: Sequence[Turn],
) -> dict[str, Any]:
    """One rescore of a segment: ``logprobs`` aligned with its ``token_ids``
    (null where none was asked for, or past ``scored_tokens`` when the
    segment grew after it was scored) and its drift."""
    scored = len(rescore.logprobs)
    # Sampled positions the rescore covers with a value.
    compared = (mask[:scored] == 1) & ~np.isnan(rescore.logprobs)
    ratio = rescore.logprobs.astype(np.float64) - rollout[:scored]
    per_turn = []
    for turn in turns:
        start, end = min(turn.completion_start, scored), min(turn.completion_end, scored)
        span = compared[start:end]
        per_turn.append({"turn": turn.index, **drift(ratio[start:end][span])})
    return {
        "target": rescore.target,
        "worker": rescore.worker,
        "model": rescore.model,
        "weight_version": rescore.weight_version,
        "positions": rescore.positions,
        "scored_tokens": scored,
        "created_at": rescore.created_at,
        "logprobs": rescore.aligned(len(rollout)),
        "drift": {**drift(ratio[compared]), "turns": per_turn},
    }


def rescore_document(session: Session, label: str) -> dict[str, Any]:
    """The answer to a rescore: that label's rescore of every segment."""
    segments = []
    for index, segment in enumerate(session.segments()):
        trajectory = segment.trajectory
        tokens = trajectory.tokens
        rescore = trajectory.rescores.get(label)
        if rescore is not None:
            fields = rescore_fields(rescore, tokens.logprobs, tokens.mask, trajectory.turns)
            segments.append({"index": index, **fields})
    return {"session_id": session.id, "label": label, "segments": segments}
