"""What the agent is answered with on the ``vllm`` engine.

The same chat completion the SGLang engines answer with (docs/engines.md#vllm
says why): ``content`` never null, reasoning under ``reasoning_content``, the
tool calls vLLM's parser found with the ids vLLM minted, ``finish_reason``
as vLLM's derenderer set it, the sampled ids and their logprobs, usage, and the
weight version(s) vLLM reports under ``metadata``. Errors the engine makes
itself are in vLLM's (and OpenAI's) shape; the worker's own are passed on as
it sent them.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from ..base import AgentReply
from ..chat_reply import sampled_logprobs
from .answer import VllmAnswer

__all__ = ["chat_completion", "error_reply"]

_JSON = [(b"content-type", b"application/json")]


def error_reply(status: int, message: str, param: str | None = None) -> AgentReply:
    """vLLM's ErrorResponse (entrypoints/serve/engine/protocol.py), as
    create_error_response writes a VLLMValidationError."""
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return AgentReply(status, list(_JSON), orjson.dumps(body))


def chat_completion(
    request_id: str, model: str, answer: VllmAnswer, *, include_reasoning: bool = True
) -> bytes:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": answer.content or "",
        "reasoning_content": answer.reasoning if include_reasoning else None,
    }
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    completion = len(answer.ids)
    usage: dict[str, Any] = {
        "prompt_tokens": answer.prompt_tokens,
        "total_tokens": answer.prompt_tokens + completion,
        "completion_tokens": completion,
    }
    if answer.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": answer.cached_tokens}
    metadata: dict[str, Any] = {"weight_version": answer.weight_version}
    if answer.weight_versions:
        metadata["weight_versions"] = answer.weight_versions
    # vLLM hides them with the reasoning (serve_tokens_full_generator).
    logprobs = sampled_logprobs(answer.logprobs, answer.token_texts) if include_reasoning else None
    return orjson.dumps(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": answer.finish_reason,
                    "stop_reason": answer.stop_reason,
                    # The sampled ids, as vLLM's token route always gives them
                    # (its chat route: with return_token_ids).
                    "token_ids": answer.ids.tolist() if include_reasoning else None,
                }
            ],
            "usage": usage,
            "metadata": metadata,
        }
    )
