"""What SGLang makes of the emulator's completion: the routed-experts blob
and the ``/v1/chat/completions`` response JSON of SGLang's models.

Like SGLang: ``meta_info`` (with ``output_token_logprobs``) is in the choice
only when the request set ``return_meta_info``; a parsed tool call turns the
finish reason into ``tool_calls`` with ``matched: null`` in the choice and in
``meta_info`` alike (SGLang rewrites the one dict both share).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rollout_session.testing.generation import Sample

__all__ = ["chat_response", "routed_experts", "routed_experts_blob"]


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


def routed_experts_blob(
    token_ids: Sequence[int], start: int, *, layers: int, top_k: int, num_experts: int
) -> str:
    """SGLang's ``routed_experts``: base64 of little-endian int32 of
    `routed_experts` (shape ``(len(token_ids) - start, layers, top_k)``)."""
    experts = routed_experts(
        token_ids, start, layers=layers, top_k=top_k, num_experts=num_experts
    ).astype("<i4")
    return base64.b64encode(experts.tobytes()).decode("ascii")


def chat_response(
    sample: Sample,
    *,
    rid: str,
    model: str,
    prompt_tokens: int,
    cached_tokens: int,
    weight_version: str,
    e2e_latency: float,
    routed_experts: str | None,
    meta_info: bool,
) -> dict[str, Any]:
    """SGLang's ``/v1/chat/completions`` answer (``meta_info`` if asked for)."""
    finish = dict(sample.finish)
    message = sample.message
    if message.get("tool_calls"):
        finish = {"type": "tool_calls", "matched": None}
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish["type"],
        "matched_stop": finish.get("matched"),
    }
    n = len(sample.ids)
    if meta_info:
        choice["meta_info"] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "cached_tokens": cached_tokens,
            "reasoning_tokens": sample.reasoning_tokens,
            "weight_version": weight_version,
            "num_retractions": 0,
            "e2e_latency": e2e_latency,
            "output_token_logprobs": [
                [lp, tok, None] for lp, tok in zip(sample.logprobs, sample.ids, strict=True)
            ],
            "output_token_logprobs_length": n,
        }
        if routed_experts is not None:
            choice["meta_info"]["routed_experts"] = routed_experts
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + n,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "reasoning_tokens": sample.reasoning_tokens,
        },
    }
