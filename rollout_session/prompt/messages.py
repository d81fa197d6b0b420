"""Chat messages: validation of what agents send, and history matching.

A session stores its conversation as normalised messages (content flattened
to a string). A later request must start with that conversation; `match`
compares on what changes what the model saw — ``role``, ``content``,
``tool_calls`` (function name + parsed JSON arguments; ids and key order are
ignored) and ``reasoning_content`` only when the request carries it —
treating ``None``, ``""`` and ``[]`` as equal (docs/api.md#history-rules).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from ..errors import InvalidRequest

# Roles a request may carry. "developer" is OpenAI's newer name for system.
KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

__all__ = ["Message", "assistant_message", "common_prefix", "normalize_messages"]

# A normalised message: plain dict handed to the chat template as is.
Message = dict[str, Any]


def _text(content: Any, where: str) -> str | None:
    """Flatten OpenAI content (string or list of text parts) to a string."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequest(
                    f"{where}.content[{i}]: only text content parts are supported",
                    param=f"{where}.content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"{where}.content[{i}].text must be a string", param=where)
            pieces.append(text)
        return "".join(pieces)
    raise InvalidRequest(f"{where}.content must be a string, a list or null", param=where)


def _arguments(raw: Any, where: str) -> Any:
    """Tool-call arguments as the template expects them: a parsed JSON object
    when the agent sent a JSON string of one (HF convention), else unchanged."""
    if isinstance(raw, str):
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
        return parsed if isinstance(parsed, dict) else raw
    if isinstance(raw, dict):
        return raw
    raise InvalidRequest(f"{where}.arguments must be a string or an object", param=where)


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequest(f"{where}.tool_calls must be a list", param=where)
    calls = []
    for i, call in enumerate(raw):
        at = f"{where}.tool_calls[{i}]"
        if not isinstance(call, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"{at}.function.name must be a string", param=at)
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequest(f"{at}.id must be a string", param=at)
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "arguments": _arguments(fn.get("arguments", {}), f"{at}.function"),
                },
            }
        )
    return calls


def _normalize(raw: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    role = raw.get("role")
    # A str check first: `in` on a frozenset hashes, and a list role does not.
    if not isinstance(role, str) or role not in KNOWN_ROLES:
        raise InvalidRequest(
            f"{where}.role must be one of {sorted(KNOWN_ROLES)}, got {role!r}",
            param=f"{where}.role",
        )
    message: Message = {"role": role, "content": _text(raw.get("content"), where)}
    if role == "assistant":
        message["tool_calls"] = _tool_calls(raw.get("tool_calls"), where)
        reasoning = raw.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise InvalidRequest(f"{where}.reasoning_content must be a string", param=where)
        message["reasoning_content"] = reasoning
    elif role == "tool":
        call_id = raw.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequest(f"{where}.tool_call_id must be a string", param=where)
        message["tool_call_id"] = call_id
    name = raw.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidRequest(f"{where}.name must be a string", param=where)
        message["name"] = name
    return message


def normalize_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    return [_normalize(m, i) for i, m in enumerate(raw)]


def assistant_message(
    content: str | None, tool_calls: list[dict[str, Any]], reasoning: str | None
) -> Message:
    """The normalised form of an answer we returned, stored as history."""
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": _tool_calls(tool_calls, "answer"),
        "reasoning_content": reasoning,
    }


def _calls_key(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _same(stored: Message, incoming: Message) -> bool:
    if stored["role"] != incoming["role"]:
        return False
    if (stored["content"] or "") != (incoming["content"] or ""):
        return False
    if _calls_key(stored.get("tool_calls") or []) != _calls_key(incoming.get("tool_calls") or []):
        return False
    # Most clients drop reasoning_content from history; compare only when sent.
    theirs = incoming.get("reasoning_content")
    return theirs is None or (stored.get("reasoning_content") or "") == theirs


def common_prefix(stored: Sequence[Message], incoming: Sequence[Message]) -> int:
    """Number of leading messages the two conversations share."""
    n = 0
    for a, b in zip(stored, incoming, strict=False):
        if not _same(a, b):
            break
        n += 1
    return n
