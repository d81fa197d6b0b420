"""What SGLang makes of the emulator's completion: the sampled text parsed
into an OpenAI message the way SGLang's Qwen3 reasoning parser and Qwen2.5
tool-call parser do it, the routed-experts blob, and the
``/v1/chat/completions`` response JSON of SGLang's models (with
``return_meta_info``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

if TYPE_CHECKING:
    from .generation import Sample

__all__ = ["chat_response", "parse_tool_calls", "routed_experts_blob", "split_reasoning"]

_TOOL_CALL_RE: Final = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def split_reasoning(text: str) -> tuple[str, str]:
    """SGLang's Qwen3 reasoning parser: (reasoning_content, content)."""
    if "<think>" not in text:
        return "", text
    body = text.replace("<think>", "").strip()
    reasoning, end, rest = body.partition("</think>")
    if not end:  # cut before the block closed: everything is reasoning
        return reasoning, ""
    return reasoning.strip(), rest.strip()


def parse_tool_calls(text: str, seed: int) -> list[dict[str, Any]]:
    """SGLang's Qwen2.5 tool-call parser; unparsable calls stay in the content."""
    calls: list[dict[str, Any]] = []
    for match in _TOOL_CALL_RE.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return []
        call_id = hashlib.blake2b(f"{seed}:{len(calls)}".encode(), digest_size=12).hexdigest()
        calls.append(
            {
                "id": f"call_{call_id}",
                "index": len(calls),
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
                },
            }
        )
    return calls


def routed_experts_blob(
    token_ids: Sequence[int], start: int, *, layers: int, top_k: int, num_experts: int
) -> str:
    """Base64 of little-endian int32 ``(len(token_ids) - start, layers, top_k)``.

    ``token_ids`` are the forwarded positions (prompt + completion minus the
    last sampled token). The expert at (position p, layer, k) is a hash of
    (token at p, p, layer, k) only, so blobs of consecutive turns with
    ``start`` = the previous turn's forwarded length concatenate to the blob of
    the whole sequence.
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
    experts = (h % np.uint64(num_experts)).astype("<i4")
    return base64.b64encode(experts.tobytes()).decode("ascii")


def chat_response(
    sample: Sample,
    message: dict[str, Any],
    *,
    rid: str,
    model: str,
    prompt_tokens: int,
    cached_tokens: int,
    weight_version: str,
    e2e_latency: float,
    routed_experts: str | None,
) -> dict[str, Any]:
    """SGLang's ``/v1/chat/completions`` answer with ``return_meta_info``."""
    finish = sample.finish
    stopped = finish["type"] == "stop"
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls"
        if message.get("tool_calls")
        else ("stop" if stopped else "length"),
    }
    if stopped:
        choice["matched_stop"] = finish["matched"]
    n = len(sample.ids)
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
