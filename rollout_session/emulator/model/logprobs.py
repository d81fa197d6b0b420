"""The emulator model's log-probabilities: `LogprobModel`.

A real engine's logprob of token ``t`` after context ``c`` is a function of
its weights, ``c`` and ``t``; so is the emulator's:

    logprob(seed, version, ids[:p], ids[p]) = TABLE[mix(key(seed, version), H(ids[: p + 1]))]

- ``H`` is a polynomial rolling hash over the ids up to and including the
  token (mod 2^64, computed for every prefix of a sequence at once with
  numpy: O(n), no per-token Python objects);
- ``key`` mixes the emulator's ``seed`` (a "teacher" is an emulator with
  another seed) with the weight version label (after a weight update the
  same tokens score differently), and ``mix`` is SplitMix64's finaliser;
- ``TABLE`` maps the top 16 bits of the mixed hash to ``-(Exp(0.3) quantile
  + 1e-4)``, rounded to 4 decimals: finite, in [-3.5352, -0.0001]. A table
  lookup, not a vectorised ``log``, so a value never depends on which other
  positions were scored in the same call (numpy's SIMD ``log`` may differ in
  the last bit between lanes and the tail loop).

The logprobs the emulator reports for the tokens it samples and the prompt
logprobs it reports for a prefill (SGLang's ``input_token_logprobs``, vLLM's
``prompt_logprobs``) are both this function: rescoring a sampled
trajectory on the same emulator, under the same version, gives back exactly
the sampled tokens' logprobs. ``rank`` (vLLM's) is ``floor(exp(-logprob))``,
at least 1: the largest rank a token of that probability can have.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["LogprobModel", "Scores", "rank_of"]

# The hash base (FNV-1's 64-bit prime: odd, so invertible mod 2^64).
_BASE: Final = 0x100000001B3
_BASE_INVERSE: Final = pow(_BASE, -1, 1 << 64)
_SCALE: Final = 0.3  # the mean of -logprob, as the emulator's sampler always had
_BITS: Final = 16
_SHIFT: Final = np.uint64(64 - _BITS)


def rank_of(logprob: float) -> int:
    """vLLM's ``rank`` of a token of this logprob: ``floor(exp(-logprob))``,
    at least 1 (the most tokens that can be at least as likely)."""
    return max(1, math.floor(math.exp(-logprob)))


def _table() -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    size = 1 << _BITS
    values = [-round(-_SCALE * math.log((k + 0.5) / size) + 1e-4, 4) for k in range(size)]
    ranks = [rank_of(v) for v in values]
    return np.asarray(values, np.float64), np.asarray(ranks, np.int64)


_VALUES, _RANKS = _table()


class _Powers:
    """``BASE^j`` and ``BASE^-j`` mod 2^64 for j < len, grown on demand."""

    def __init__(self) -> None:
        self.up = np.ones(1, np.uint64)
        self.down = np.ones(1, np.uint64)

    def get(self, n: int) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        if len(self.up) < n:
            size = max(n, 2 * len(self.up))
            self.up = self._powers(_BASE, size)
            self.down = self._powers(_BASE_INVERSE, size)
        return self.up[:n], self.down[:n]

    @staticmethod
    def _powers(base: int, size: int) -> npt.NDArray[np.uint64]:
        steps = np.full(size, base, np.uint64)
        steps[0] = 1
        return np.cumprod(steps, dtype=np.uint64)  # wraps mod 2^64, as wanted


_POWERS: Final = _Powers()


def prefix_hashes(ids: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """``H(ids[: p + 1])`` for every p: ``sum_j (ids[j] + 1) * BASE^(p - j)``
    mod 2^64, as ``BASE^p * cumsum((ids[j] + 1) * BASE^-j)``."""
    x = np.asarray(ids, np.int64).astype(np.uint64) + np.uint64(1)
    up, down = _POWERS.get(len(x))
    hashes: npt.NDArray[np.uint64] = up * np.cumsum(x * down, dtype=np.uint64)
    return hashes


class Scores:
    """Logprobs (and vLLM ranks) of some positions of a sequence."""

    __slots__ = ("_codes",)

    def __init__(self, codes: npt.NDArray[np.uint64]) -> None:
        self._codes = codes

    def __len__(self) -> int:
        return len(self._codes)

    def logprobs(self) -> list[float]:
        values: list[float] = _VALUES[self._codes].tolist()
        return values

    def ranks(self) -> list[int]:
        ranks: list[int] = _RANKS[self._codes].tolist()
        return ranks


class LogprobModel:
    """The log-probabilities of one emulator's model (its ``seed``)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._keys: dict[str, np.uint64] = {}

    def _key(self, version: str) -> np.uint64:
        key = self._keys.get(version)
        if key is None:
            digest = hashlib.blake2b(f"{self.seed}\0{version}".encode(), digest_size=8).digest()
            key = self._keys[version] = np.uint64(int.from_bytes(digest, "little"))
        return key

    def _codes(self, hashes: npt.NDArray[np.uint64], version: str) -> npt.NDArray[np.uint64]:
        z = hashes ^ self._key(version)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        codes: npt.NDArray[np.uint64] = z >> _SHIFT
        return codes

    def score(self, ids: Sequence[int], version: str, start: int = 0) -> Scores:
        """The logprob of ``ids[p]`` after ``ids[:p]`` under ``version``,
        for p in ``[start, len(ids))`` (p = 0 scores the first token alone:
        engines report none for it)."""
        hashes = prefix_hashes(ids)
        return Scores(self._codes(hashes[start:], version))

    def sampled(
        self,
        prompt: Sequence[int],
        ids: Sequence[int],
        versions: Sequence[tuple[str, int, int]],
    ) -> list[float]:
        """The logprobs of the answer ``ids`` sampled after ``prompt``, its
        tokens ``[start, end)`` under each ``(version, start, end)`` (they
        cover the answer)."""
        if not ids:
            return []
        hashes = prefix_hashes([*prompt, *ids])[len(prompt) :]
        out: list[float] = []
        for version, start, end in versions:
            if end > start:
                out.extend(Scores(self._codes(hashes[start:end], version)).logprobs())
        if len(out) != len(ids):
            raise ValueError(f"versions cover {len(out)} of the answer's {len(ids)} tokens")
        return out
