"""Rescores: a segment's logprobs under another policy, by label
(docs/training.md#rescoring).

A `Rescore` holds one logprob per position of the segment's first `len`
tokens as they were when it was scored, NaN where none was asked for or
given. Token ids are causal: a position's logprob depends only on the
tokens before it, so when a rollback cuts the segment the rescore is cut to
the same length and stays exact (`Trajectory.commit` and `undo` cut it).
Rescores live in memory with their trajectory; the journal does not record
them (after a restart a segment's ``rescores`` is empty, never stale).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["Positions", "Rescore"]

Positions = Literal["sampled", "all"]


@dataclass(frozen=True, slots=True)
class Rescore:
    # One per position of the segment's first len(logprobs) tokens; NaN
    # where not requested (`positions`) and at position 0 (nothing precedes it).
    logprobs: npt.NDArray[np.float32]
    positions: Positions
    target: str  # "pinned", "teacher" or the URL the trainer named
    worker: str  # the worker that scored it
    model: str | None  # the model that worker serves
    weight_version: str | None  # the policy version the worker reported
    created_at: float

    def aligned(self, length: int) -> npt.NDArray[np.float32]:
        """The logprobs over a segment of `length` tokens: NaN past the
        positions scored (the segment grew after)."""
        out = np.full(length, np.nan, np.float32)
        out[: len(self.logprobs)] = self.logprobs[:length]
        return out

    def cut(self, length: int) -> Rescore:
        """This rescore over the first `length` positions only."""
        if length >= len(self.logprobs):
            return self
        return replace(self, logprobs=self.logprobs[:length])
