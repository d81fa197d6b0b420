"""The chat completion SGLang's chat route would have answered with.

Built from a checked ``/generate`` answer and its parse, field by field as
``serving_chat._build_chat_response`` builds it (SGLang 0.5.23): content
never null, ``reasoning_content`` null when there is none, ``finish_reason``
``tool_calls`` when calls were found (``matched_stop`` then null), tool-call
ids from ``_process_tool_call_id``, ``meta_info`` as the worker sent it
(the server always asks for it), usage from ``UsageProcessor``, and the
weight version under ``metadata``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from ..base import AgentReply
from ..chat_reply import sampled_logprobs
from .answer import GenerateAnswer
from .parsers import Parsers

__all__ = ["ParsedAnswer", "chat_completion", "error_reply", "parse_json_array", "tool_call_id"]

_JSON = [(b"content-type", b"application/json")]


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish: dict[str, Any]  # type, matched


def error_reply(status: int, message: str) -> AgentReply:
    """An error in the chat route's shape (serving_base.create_error_response)."""
    kind = "BadRequest" if status == 400 else "InternalServerError"
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return AgentReply(status, list(_JSON), orjson.dumps(body))


def tool_call_id(parsers: Parsers, call: dict[str, Any], history: int) -> str:
    """serving_chat._process_tool_call_id."""
    if parsers.kimi_ids:
        return f"functions.{call['name']}:{history + int(call.get('tool_index', 0))}"
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_json_array(text: str, finish: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """A forced tool_choice's JSON-array answer (serving_chat._process_tool_calls):
    (content, calls); on a parse failure the text stays the content. `finish`
    is updated in place as SGLang does: a stop becomes ``tool_calls`` with
    ``matched`` null before parsing, and only the type is restored on a
    failure (``matched`` stays null)."""
    original = finish["type"]
    if original == "stop":
        finish["type"], finish["matched"] = "tool_calls", None
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        finish["type"] = original
        return text, []
    items = [data] if isinstance(data, dict) else data
    if not isinstance(items, list) or not all(
        isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
    ):
        finish["type"] = original
        return text, []
    calls = [
        {
            "name": item["name"],
            "parameters": json.dumps(item.get("parameters", {}), ensure_ascii=False),
            "tool_index": n,
        }
        for n, item in enumerate(items)
    ]
    return "", calls


def chat_completion(rid: str, model: str, answer: GenerateAnswer, parsed: ParsedAnswer) -> bytes:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content,
        "reasoning_content": parsed.reasoning,
    }
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    completion = len(answer.ids)
    usage: dict[str, Any] = {
        "prompt_tokens": answer.prompt_tokens,
        "total_tokens": answer.prompt_tokens + completion,
        "completion_tokens": completion,
        "reasoning_tokens": answer.reasoning_tokens or 0,
    }
    if answer.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": answer.cached_tokens}
    if answer.reasoning_tokens:
        usage["completion_tokens_details"] = {"reasoning_tokens": answer.reasoning_tokens}
    metadata: dict[str, Any] = {"weight_version": answer.weight_version}
    if answer.weight_versions is not None:
        metadata["weight_versions"] = answer.weight_versions
    return orjson.dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": sampled_logprobs(answer.logprobs, answer.token_texts),
                    "finish_reason": parsed.finish["type"],
                    "matched_stop": parsed.finish.get("matched"),
                    "meta_info": orjson.Fragment(answer.meta_json),
                }
            ],
            "usage": usage,
            "metadata": metadata,
        }
    )
