"""The OpenAI Responses API on a session: ``POST …/v1/responses``.

A Responses request is the same turn as a chat request: it is converted into
one (`chat_body`), run through the turn path (gate, token-in/token-out,
sticky worker, strict validation, commit, segments), and the worker's chat
answer is rendered back as a ``Response`` (`render_response`) or as its
documented event stream (`response_events`). Only the conversion lives here.

Conversion (docs/api.md#post-sessionsidv1responses):

- ``instructions`` → a first ``system`` message; ``input`` (a string: one user
  message; or items) → chat messages. Consecutive assistant items (a
  ``reasoning`` item, an assistant ``message``, ``function_call`` items) make
  one assistant message (``reasoning_content``, ``content``, ``tool_calls``),
  as a chat client would have echoed the answer; ``function_call_output`` →
  a ``tool`` message.
- ``previous_response_id`` names a response this session gave in its
  current segment: the session's stored conversation up to that answer comes
  first (the session holds it; nothing else is stored). Response ids carry
  their segment, turn and commit time, so they survive a restart.
- function ``tools`` and ``tool_choice`` map one to one; built-in tools
  (web search, file search, computer use …), file and image inputs,
  ``background`` and ``conversation`` are refused, naming the feature.
- ``max_output_tokens`` → ``max_tokens``; ``text.format`` → ``response_format``;
  ``temperature``, ``top_p`` as they are; ``store``, ``include``,
  ``truncation``, ``reasoning``, ``metadata``, ``user``,
  ``parallel_tool_calls``, ``service_tier``, ``prompt_cache_key`` are
  accepted and not forwarded (``top_logprobs`` and ``include`` still of
  their documented types). Any other field (SGLang extras sent with
  ``extra_body``) is forwarded as on the chat route.
- the conversation, history included, is checked by `check_conversation`
  (a ``function_call_output`` must answer a call of the answer before it),
  each defect named as its ``input`` item (``input[2].call_id``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ...errors import InvalidRequest
from ...prompt.messages import Message, check_conversation, field_table
from ...session.trajectory import Turn
from ...turn.request import (
    ChatRequest,
    chat_request,
    check_int,
    check_schema,
    parse_json_object,
    tool_list,
)
from .sse import encode_typed_events, text_pieces

__all__ = [
    "ResponsesRequest",
    "chat_of",
    "parse_responses_request",
    "render_response",
    "response_events",
    "response_id",
    "turn_of_response",
]

# Consumed here (converted) or accepted and dropped; the rest is forwarded.
_CONVERTED: Final = frozenset(
    {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "text",
        "stream",
        "previous_response_id",
    }
)
_IGNORED: Final = frozenset(
    {
        "store",
        "include",
        "truncation",
        "reasoning",
        "metadata",
        "user",
        "parallel_tool_calls",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "stream_options",
        "top_logprobs",
    }
)
_REFUSED: Final = {
    "background": "background responses",
    "conversation": "conversations (the session is the conversation)",
    "prompt": "prompt templates",
}
_TEXT_PARTS: Final = frozenset(
    {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
)
_RESPONSE_ID = re.compile(r"resp_(\d+)_(\d+)_[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    raw: dict[str, Any]  # the request as sent (echoed in the Response)
    messages: list[Message]  # from `input` (and `instructions`), without history
    chat: dict[str, Any]  # the chat request, `messages` still to be set
    stream: bool
    previous_response_id: str | None
    fields: list[dict[str, str]]  # per message, its fields' names in the request


def parse_responses_request(body: bytes) -> ResponsesRequest:
    raw = parse_json_object(body)
    for name, feature in _REFUSED.items():
        if raw.get(name) not in (None, False):
            raise InvalidRequest(f"{feature} are not supported", param=name)
    stream = raw.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    previous = raw.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidRequest("previous_response_id must be a string", param="previous_response_id")
    if not isinstance(raw.get("metadata", {}), dict):  # else echoed in the Response as sent
        raise InvalidRequest("metadata must be an object", param="metadata")
    instructions = raw.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions must be a string", param="instructions")
    _check_ignored(raw)
    messages, fields = _input_messages(raw.get("input"))
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
        fields.insert(0, {"": "instructions"})
    chat = {k: v for k, v in raw.items() if k not in _CONVERTED and k not in _IGNORED}
    tools = _tools(raw.get("tools"))
    if tools:
        chat["tools"] = tools
    if raw.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(raw["tool_choice"])
    if raw.get("max_output_tokens") is not None:
        chat["max_tokens"] = raw["max_output_tokens"]
    response_format = _response_format(raw.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return ResponsesRequest(raw, messages, chat, stream, previous, fields)


def _check_ignored(raw: dict[str, Any]) -> None:
    """Fields accepted and not forwarded still have their documented types
    (OpenAI's, which SGLang's and vLLM's ResponsesRequest validate)."""
    check_int(raw, "top_logprobs", 0, 20)
    include = raw.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(v, str) for v in include)
    ):
        # Any string: OpenAI adds includables, and none changes a turn here.
        raise InvalidRequest("include must be a list of strings", param="include")


def chat_of(request: ResponsesRequest, history: Sequence[Message]) -> ChatRequest:
    """The chat request: `history` (a previous response's conversation), then
    the request's own messages. With history, `instructions` replace its
    first system message rather than adding one (OpenAI does not carry a
    previous response's instructions over). The conversation is checked
    whole, so a function_call_output answers a call of the previous
    response; defects are named as `input` items."""
    messages, fields = list(request.messages), request.fields
    own: list[Message] = []
    if history:
        own = list(history)
        if messages and messages[0]["role"] == "system" and request.raw.get("instructions"):
            system, fields = messages.pop(0), fields[1:]
            if own and own[0]["role"] == "system":
                own[0] = system
            else:
                own.insert(0, system)
    chat = chat_request({**request.chat, "messages": own + messages, "stream": False})
    check_conversation(chat.messages, start=len(own), field=field_table(fields, len(own)))
    return chat


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of parts", param=where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"{where}[{i}] of type {kind!r} is not supported: only text parts",
                param=f"{where}[{i}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _input_messages(items: Any) -> tuple[list[Message], list[dict[str, str]]]:
    """The chat messages of `input`, and for each the names of its fields in
    the request (`field_table`): ``input[2].call_id`` rather than the chat
    message's ``messages[3].tool_call_id``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [{"": "input"}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("input must be a string or a non-empty list of items", param="input")
    messages: list[Message] = []
    fields: list[dict[str, str]] = []
    answer: dict[str, Any] | None = None  # the assistant message being assembled
    answer_fields: dict[str, str] = {}

    def flush() -> None:
        nonlocal answer
        if answer is not None:
            messages.append(answer)
            fields.append(answer_fields)
            answer = None

    def assemble(where: str) -> dict[str, Any]:
        nonlocal answer, answer_fields
        if answer is None:
            answer, answer_fields = {"role": "assistant", "content": ""}, {"": where}
        return answer

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(
                    f"{where}.role must be user, assistant, system or developer",
                    param=f"{where}.role",
                )
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                assemble(where)["content"] += text
                answer_fields.setdefault("content", f"{where}.content")
            else:
                flush()
                messages.append({"role": role, "content": text})
                fields.append({"": where})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise InvalidRequest(
                    f"{where} needs string call_id, name and arguments", param=where
                )
            calls = assemble(where).setdefault("tool_calls", [])
            answer_fields[f"tool_calls[{len(calls)}]"] = where
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}.call_id must be a string", param=f"{where}.call_id")
            flush()
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            fields.append({"": where, "tool_call_id": f"{where}.call_id"})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text(parts, f"{where}.content")
            assembled = assemble(where)
            if text:
                assembled["reasoning_content"] = text
        else:
            raise InvalidRequest(
                f"{where} of type {kind!r} is not supported: message, function_call, "
                "function_call_output and reasoning items are",
                param=f"{where}.type",
            )
    flush()
    return messages, fields


def _tools(tools: Any) -> list[dict[str, Any]]:
    converted = []
    for i, tool in enumerate(tool_list(tools)):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise InvalidRequest(
                f"tools[{i}] of type {kind!r} is not supported: only function tools (the "
                "model runs on your workers; built-in tools are OpenAI's)",
                param=f"tools[{i}]",
            )
        # Here, not in chat_request: named as the Responses API does.
        check_schema(tool.get("parameters"), f"tools[{i}].parameters")
        function = {"name": tool["name"]}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        "tool_choice must be auto, none, required or {'type': 'function', 'name': …}",
        param="tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        # Else it was accepted, ignored, and echoed back in the Response.
        raise InvalidRequest("text must be an object", param="text")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt, dict) and isinstance(fmt.get("schema"), dict):
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest(
        "text.format must be text, json_object or json_schema (with a schema)",
        param="text.format",
    )


# --- response ids ---


def response_id(segment: int, turn: Turn) -> str:
    """The id of the response a turn gave: its segment, its index, and its
    commit time (so an id of a replaced turn no longer resolves)."""
    return f"resp_{segment}_{turn.index}_{int(turn.created_at * 1e6):x}"


def turn_of_response(response: str, segment: int, turns: Sequence[Turn]) -> Turn:
    """The turn of the current segment `response` names, or 400."""
    found = _RESPONSE_ID.fullmatch(response)
    if found is not None:
        seg, index = int(found[1]), int(found[2])
        if seg == segment and index < len(turns) and response_id(seg, turns[index]) == response:
            return turns[index]
    raise InvalidRequest(
        f"previous_response_id {response!r} is no response of this session's current "
        "segment (send the whole input instead)",
        param="previous_response_id",
    )


# --- the answer ---


def render_response(
    answer: dict[str, Any], request: ResponsesRequest, rid: str, *, previous: str | None
) -> dict[str, Any]:
    """The worker's chat answer as a Response."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{rid}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
            }
        )
    content = message.get("content")
    if content:
        output.append(
            {
                "type": "message",
                "id": f"msg_{rid}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": content, "annotations": []}],
            }
        )
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{call.get('id')}",
                "call_id": call.get("id"),
                "name": function.get("name"),
                "arguments": arguments
                if isinstance(arguments, str)
                else orjson.dumps(arguments).decode(),
                "status": "completed",
            }
        )
    usage = answer.get("usage") or {}
    cut = choice.get("finish_reason") == "length"
    raw = request.raw
    return {
        "id": rid,
        "object": "response",
        "created_at": int(answer.get("created") or time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": answer.get("model") or raw.get("model"),
        "instructions": raw.get("instructions"),
        "output": output,
        "parallel_tool_calls": raw.get("parallel_tool_calls", True),
        "previous_response_id": previous,
        "reasoning": raw.get("reasoning"),
        "store": raw.get("store", True),
        "temperature": raw.get("temperature"),
        "text": raw.get("text") or {"format": {"type": "text"}},
        "tool_choice": raw.get("tool_choice", "auto"),
        "tools": raw.get("tools") or [],
        "top_p": raw.get("top_p"),
        "max_output_tokens": raw.get("max_output_tokens"),
        "truncation": "disabled",
        "metadata": raw.get("metadata") or {},
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                or 0
            },
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens") or 0},
            "total_tokens": usage.get("total_tokens", 0),
        },
    }


def response_events(response: dict[str, Any]) -> bytes:
    """The Responses event stream for a complete `response`, after the fact
    (the turn was generated and committed whole, as on the chat route)."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    started = {**response, "status": "in_progress", "output": [], "incomplete_details": None}
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        kind = item["type"]
        if kind == "message":
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            text = item["content"][0]["text"]
            # Every event of the message's one content part names it the same way.
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            part = {"type": "output_text", "text": "", "annotations": []}
            emit("response.content_part.added", **at, part=part)
            for piece in text_pieces(text):
                emit("response.output_text.delta", **at, delta=piece, logprobs=[])
            emit("response.output_text.done", **at, text=text, logprobs=[])
            emit("response.content_part.done", **at, part=item["content"][0])
        elif kind == "function_call":
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            for piece in text_pieces(item["arguments"]):
                emit(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=piece,
                )
            emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
                name=item["name"],
            )
        else:  # reasoning: whole, in its item events
            emit("response.output_item.added", output_index=index, item=item)
        emit("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    emit(final, response=response)
    return encode_typed_events(events)
