"""Token arrays: the one type of token ids and of their logprobs.

Every wing that holds tokens (the trajectory, the engines' answers, the
prompt's junctions, the export) uses these two: compact numpy arrays, never
Python lists of ints (docs/performance.md#compact-token-arrays).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["IdArray", "LogprobArray"]

IdArray = npt.NDArray[np.int32]
LogprobArray = npt.NDArray[np.float32]
