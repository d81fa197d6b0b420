"""The experts the emulator's mixture-of-experts model routes each position to.

Engine-neutral: SGLang's ``routed_experts`` (base64 int32, `sglang.answer`)
and vLLM's (an ``.npy`` blob, `vllm.answer`) report the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["routed_experts"]


def routed_experts(
    token_ids: Sequence[int], start: int, *, layers: int, top_k: int, num_experts: int
) -> np.ndarray:
    """Expert ids of shape ``(len(token_ids) - start, layers, top_k)``, in
    ``[0, num_experts)`` (uint64).

    ``token_ids`` are the forwarded positions (prompt + completion minus the
    last sampled token). The expert at (position p, layer, k) is a hash of
    (token at p, p, layer, k) only, so arrays of consecutive turns with
    ``start`` = the previous turn's forwarded length concatenate to the array
    of the whole sequence (on every engine).
    """
    ids = np.asarray(token_ids[start:], dtype=np.uint64)
    pos = np.arange(start, len(token_ids), dtype=np.uint64)
    layer = np.arange(layers, dtype=np.uint64)
    k = np.arange(top_k, dtype=np.uint64)
    h = (
        ids[:, None, None] * np.uint64(0x9E3779B97F4A7C15)
        ^ pos[:, None, None] * np.uint64(0xC2B2AE3D27D4EB4F)
        ^ layer[None, :, None] * np.uint64(0x165667B19E3779F9)
        ^ k[None, None, :] * np.uint64(0x27D4EB2F165667C5)
    )
    # splitmix64 finaliser so neighbouring positions get unrelated experts.
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(29)
    experts: np.ndarray = h % np.uint64(num_experts)
    return experts
