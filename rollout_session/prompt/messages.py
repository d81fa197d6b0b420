"""Chat messages: validation of what agents send, and history matching.

A session stores its conversation as normalised messages (content flattened
to a string). A later request must start with that conversation; `match`
compares on what changes what the model saw — ``role``, ``content``,
``tool_calls`` (function name + parsed JSON arguments; ids and key order are
ignored) and ``reasoning_content`` only when the request carries it —
treating ``None``, ``""`` and ``[]`` as equal (docs/api.md#history-rules).

`check_conversation` refuses what no model could have been asked: a message
without content, a tool result that answers no call, calls left unanswered
(docs/api.md#what-a-conversation-must-hold). Every protocol converts into
chat messages and applies it there, naming the field in its own terms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from ..errors import InvalidRequest

# Roles a request may carry. "developer" is OpenAI's newer name for system.
KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

__all__ = [
    "FieldName",
    "Message",
    "assistant_message",
    "chat_field",
    "check_conversation",
    "common_prefix",
    "field_table",
    "normalize_messages",
]

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


# --- what a conversation must hold ---

# The request's own name of a field of the chat message at an index: the
# field is "" (the message itself), "content", "tool_call_id" or
# "tool_calls[k]". The Responses and Messages codecs convert into chat
# messages, whose indices would mislead their agents.
FieldName = Callable[[int, str], str]

# Roles whose content OpenAI requires (openai-python's
# ChatCompletion{User,System,Developer}MessageParam) and without which a
# prompt means nothing: SGLang's ChatCompletionMessageUserParam requires it,
# and templates fail on a null system message. A null tool result is let
# through: SGLang and vLLM take it, and templates render an empty result.
_CONTENT_REQUIRED = frozenset({"user", "system", "developer"})


def chat_field(index: int, field: str) -> str:
    """The chat route's name: ``messages[3].tool_call_id``."""
    where = f"messages[{index}]"
    return f"{where}.{field}" if field else where


def field_table(names: Sequence[Mapping[str, str]], offset: int = 0) -> FieldName:
    """A codec's names: `names[i - offset]` maps the chat message's fields to
    the request's ("" to the item or block it came from)."""

    def name(index: int, field: str) -> str:
        fields = names[index - offset]
        return fields.get(field) or fields[""]

    return name


def _call_label(call: Mapping[str, Any]) -> str:
    name = call["function"]["name"]
    call_id = call.get("id")
    return f"{call_id!r} ({name})" if call_id is not None else f"{name!r}"


def check_conversation(
    messages: Sequence[Message], *, start: int = 0, field: FieldName = chat_field
) -> None:
    """400 for a conversation that makes a trajectory meaningless, naming the
    field with `field`; each rule is one OpenAI, Anthropic and the engines'
    validators share (the table: docs/api.md#what-a-conversation-must-hold):

    - a user, system or developer message without content (null);
    - an assistant message with neither content (null), tool calls nor
      reasoning: a model's empty answer is ``content: ""`` and stays sendable;
    - a tool result where the preceding answer has no calls, or whose
      ``tool_call_id`` is none of its call ids;
    - a user or assistant message while calls of the preceding answer are
      unanswered. System and developer messages between the calls and their
      results are let through (Claude Code interleaves system messages).

    `messages` are normalised chat messages, or a codec's converted ones
    (the same keys; optional ones may be absent). Those before `start` are a
    stored history (a previous response's): they give the calls a tool result
    answers, but are not themselves refused — a defect is named at `start`
    or after.
    """
    calls: list[Mapping[str, Any]] = []  # the preceding answer's tool calls
    ids: list[Any] = []  # their ids (None where a call has none)
    answer_at = -1  # that answer's index
    unanswered: list[int] = []  # indices into `calls`

    def refuse(index: int, name: str, problem: str) -> None:
        param = field(index, name)
        raise InvalidRequest(f"{param}: {problem}", param=param)

    for i, message in enumerate(messages):
        role = message["role"]
        checked = i >= start
        if checked and message.get("content") is None:
            if role in _CONTENT_REQUIRED:
                refuse(i, "content", f"a {role} message needs content")
            if role == "assistant" and not (
                message.get("tool_calls") or message.get("reasoning_content") is not None
            ):
                refuse(
                    i,
                    "content",
                    "an assistant message needs content or tool_calls (a model's empty "
                    'answer is content "")',
                )
        if role == "tool":
            call_id = message.get("tool_call_id")
            matched = call_id is not None and call_id in ids
            if matched:
                unanswered = [k for k in unanswered if ids[k] != call_id]
            elif calls and (call_id is None or not any(ids)):
                if unanswered:
                    unanswered.pop(0)  # no id to match: results answer calls in order
            elif checked:
                refuse(
                    i,
                    "tool_call_id",
                    f"{call_id!r} answers no tool call of the preceding answer (its call "
                    f"ids: {', '.join(repr(c) for c in ids if c is not None)})"
                    if calls
                    else "a tool result must answer a tool call of the preceding answer, "
                    "and there is none",
                )
        elif role == "user" or role == "assistant":
            if unanswered and checked:
                k = unanswered[0]
                at, name = (answer_at, f"tool_calls[{k}]") if answer_at >= start else (i, "")
                refuse(
                    at,
                    name,
                    f"tool call {_call_label(calls[k])} has no tool result before the next "
                    f"{role} message: every call of an answer is answered first",
                )
            calls = (message.get("tool_calls") or []) if role == "assistant" else []
            ids = [c.get("id") for c in calls]
            answer_at, unanswered = i, list(range(len(calls)))
