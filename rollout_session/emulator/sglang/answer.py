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

from rollout_session.emulator.model.routed_experts import routed_experts

if TYPE_CHECKING:
    from rollout_session.emulator.model.generation import Sample

__all__ = ["chat_response", "routed_experts_blob"]


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
    message: dict[str, Any],
    reasoning_tokens: int,
    rid: str,
    model: str,
    prompt_tokens: int,
    cached_tokens: int,
    weight_version: str,
    e2e_latency: float,
    routed_experts: str | None,
    meta_info: bool,
    weight_versions: list[dict[str, Any]] | None = None,
    num_retractions: int = 0,
    waiting_abort: bool = False,
) -> dict[str, Any]:
    """SGLang's ``/v1/chat/completions`` answer (``meta_info`` if asked for).

    ``message``: what the worker's parsers make of the sample
    (`chat_message`); ``reasoning_tokens`` the scheduler's count
    (`worker.SglangWorker.reasoning_tokens`).

    ``weight_versions``: the answer's version spans
    (``utils/weight_versions.py`` ``add_weight_versions_to_meta_info``), in
    ``meta_info`` and, with ``weight_version``, in the top-level
    ``metadata`` (``build_endpoint_weight_version_metadata``); None: neither
    (the emulator reports them for answers that span a version change).
    ``waiting_abort``: a request aborted in the waiting queue, answered by
    the tokenizer manager (``_handle_abort_req``): its ``meta_info`` has no
    prompt, cached or reasoning counts, so ``usage`` counts them 0
    (``UsageProcessor.calculate_response_usage`` defaults).
    """
    finish = dict(sample.finish)
    if message.get("tool_calls") and finish.get("type") == "stop":
        # serving_chat._process_tool_calls: a parsed call turns "stop" into
        # "tool_calls"; "length" and "abort" stay.
        finish = {"type": "tool_calls", "matched": None}
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish["type"],
        "matched_stop": finish.get("matched"),
    }
    n = len(sample.ids)
    if waiting_abort:
        prompt_tokens = cached_tokens = 0
    if waiting_abort:
        reasoning_tokens = 0
    if meta_info:
        logprobs = [[lp, tok, None] for lp, tok in zip(sample.logprobs, sample.ids, strict=True)]
        meta: dict[str, Any]
        if waiting_abort:
            meta = {
                "id": rid,
                "finish_reason": finish,
                "weight_version": weight_version,
                "e2e_latency": e2e_latency,
            }
            if weight_versions is not None:
                meta["weight_versions"] = weight_versions
            meta.update(
                output_token_logprobs=logprobs,
                output_token_logprobs_length=n,
                completion_tokens=n,
            )
        else:
            meta = {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "cached_tokens": cached_tokens,
                "reasoning_tokens": reasoning_tokens,
                "weight_version": weight_version,
            }
            if weight_versions is not None:
                meta["weight_versions"] = weight_versions
            meta.update(
                num_retractions=num_retractions,
                e2e_latency=e2e_latency,
                output_token_logprobs=logprobs,
                output_token_logprobs_length=n,
            )
            if routed_experts is not None:
                meta["routed_experts"] = routed_experts
        choice["meta_info"] = meta
    answer: dict[str, Any] = {
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
            "reasoning_tokens": reasoning_tokens,
        },
    }
    if weight_versions is not None:
        answer["metadata"] = {"weight_version": weight_version, "weight_versions": weight_versions}
    return answer
