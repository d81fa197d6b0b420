"""Token arrays: the one type of token ids and of their logprobs.

Every wing that holds tokens (the trajectory, the engines' answers, the
prompt's junctions, the export) uses these two: compact numpy arrays, never
Python lists of ints (docs/performance.md#compact-token-arrays).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["IdArray", "LogprobArray", "VersionSpan"]

IdArray = npt.NDArray[np.int32]
LogprobArray = npt.NDArray[np.float32]


class VersionSpan(NamedTuple):
    """Sampled tokens ``[start, end)`` of a completion (offsets from its
    first sampled token) and the policy version that sampled them (None: no
    engine or trainer named one). A completion's spans tile it in order."""

    start: int
    end: int
    version: str | None
