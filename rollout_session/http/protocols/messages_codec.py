"""The Anthropic Messages API on a session: ``POST …/v1/messages``.

A Messages request is the same turn as a chat request: it is converted into
one (`parse_messages_request`), run through the turn path (gate,
token-in/token-out, sticky worker, strict validation, commit, segments), and
the worker's chat answer is rendered back as an Anthropic ``Message``
(`render_message`) or as its documented event stream (`message_events`).
Errors on these routes take Anthropic's shape (`error_body`). Only the
conversion lives here; the route is `messages.py`.

Conversion (docs/api.md#post-sessionsidv1messages), deterministic so that a
re-sent history converts to what the session stored (`prompt/messages.py` matches it):

- ``system`` (a string or text blocks) → a first ``system`` message; a
  ``system`` message within ``messages`` → a ``system`` message there.
- a user message: its ``tool_result`` blocks → ``tool`` messages in order,
  then its text blocks (joined) → one ``user`` message, if any.
- an assistant message: ``thinking`` → ``reasoning_content``, text blocks
  (joined) → ``content``, ``tool_use`` → ``tool_calls`` (the input as its
  JSON arguments); ``redacted_thinking`` has no text and is dropped.
- ``tools`` (``name``, ``description``, ``input_schema``) → function tools;
  ``tool_choice`` auto/any/tool/none → auto/required/named/none;
  ``stop_sequences`` → ``stop``; ``thinking`` enabled/disabled →
  ``chat_template_kwargs.enable_thinking``; ``max_tokens``, ``temperature``,
  ``top_p``, ``top_k`` as they are; ``metadata``, ``service_tier``,
  ``context_management`` and ``output_config`` are accepted and dropped.
  Any other field (SGLang extras sent with ``extra_body``) is forwarded as
  on the chat route.
- images, documents, server tools (web search, code execution, …) and MCP
  servers are refused with a 400 naming the feature.
- the converted conversation is checked by `check_conversation` (a
  ``tool_result`` answers a ``tool_use`` of the assistant message before it,
  every ``tool_use`` is answered), each defect named as its block
  (``messages[1].content[0].tool_use_id``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import orjson

from ...errors import InvalidRequest, RolloutSessionError
from ...prompt.messages import Message, check_conversation, field_table
from ...turn.request import check_schema, parse_json_object, tool_list
from .sse import encode_typed_events, text_pieces

__all__ = [
    "MessagesRequest",
    "error_body",
    "error_type",
    "message_events",
    "parse_messages_request",
    "render_message",
    "worker_error_message",
]

# Consumed here (converted), or accepted and dropped; the rest is forwarded.
_CONVERTED: Final = frozenset(
    {
        "model",
        "system",
        "messages",
        "tools",
        "tool_choice",
        "stop_sequences",
        "thinking",
        "stream",
        "max_tokens",
    }
)
# Anthropic's own settings, with nothing to do on a worker (Claude Code sends
# context_management and output_config.effort).
_IGNORED: Final = frozenset(
    {"metadata", "service_tier", "cache_control", "context_management", "output_config"}
)
_REFUSED: Final = {
    "mcp_servers": "MCP servers",
    "container": "containers (code execution)",
}
_UNSUPPORTED_BLOCKS: Final = {
    "image": "image content",
    "document": "document content",
    "search_result": "search result content",
    "server_tool_use": "server tools",
    "web_search_tool_result": "server tools",
    "container_upload": "containers (code execution)",
}

# Anthropic's error `type` for our statuses (409 keeps its status: the SDK
# raises ConflictError for it).
_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    model: Any  # as sent (echoed in the Message)
    chat: dict[str, Any]  # the chat-completions request body
    stream: bool
    stop_sequences: tuple[str, ...]


def parse_messages_request(body: bytes, *, count_only: bool = False) -> MessagesRequest:
    """The chat request a Messages request (or, `count_only`, a count_tokens
    request, which has no ``max_tokens``) asks for; 400 for what it cannot."""
    raw = parse_json_object(body)
    for name, feature in _REFUSED.items():
        if raw.get(name) not in (None, [], False):
            raise InvalidRequest(f"{feature} are not supported", param=name)
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: a string is required", param="model")
    stream = raw.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    if not isinstance(raw.get("metadata", {}), dict):  # dropped, but not any value
        raise InvalidRequest("metadata must be an object", param="metadata")
    chat = {k: v for k, v in raw.items() if k not in _CONVERTED and k not in _IGNORED}
    chat["model"] = model
    max_tokens = raw.get("max_tokens")
    if max_tokens is None:
        if not count_only:
            raise InvalidRequest("max_tokens: a positive integer is required", param="max_tokens")
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise InvalidRequest("max_tokens must be a positive integer", param="max_tokens")
    else:
        chat["max_tokens"] = max_tokens
    messages, fields = _system(raw.get("system"))
    converted, converted_fields = _messages(raw.get("messages"))
    messages += converted
    fields += converted_fields
    # Here, not in chat_request: the defect is named as the agent wrote it.
    check_conversation(messages, field=field_table(fields))
    chat["messages"] = messages
    tools = _tools(raw.get("tools"))
    if tools:
        chat["tools"] = tools
    if raw.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(raw["tool_choice"])
    stops = _stop_sequences(raw.get("stop_sequences"))
    if stops:
        chat["stop"] = list(stops)
    enable = _thinking(raw.get("thinking"))
    if enable is not None:
        kwargs = chat.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidRequest(
                "chat_template_kwargs must be an object", param="chat_template_kwargs"
            )
        chat["chat_template_kwargs"] = {**(kwargs or {}), "enable_thinking": enable}
    chat["stream"] = False
    return MessagesRequest(model, chat, stream, stops)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise InvalidRequest(f"{where} must be a content block (an object)", param=where)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest(f"{where}.type must be a string", param=where)
    feature = _UNSUPPORTED_BLOCKS.get(kind)
    if feature is not None:
        raise InvalidRequest(f"{where}: {feature} is not supported", param=where)
    return kind


def _block_text(block: dict[str, Any], where: str, key: str = "text") -> str:
    text = block.get(key)
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.{key} must be a string", param=where)
    return text


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined (tool results, the system prompt)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text blocks", param=where)
    pieces = []
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        if _block_type(block, at) != "text":
            raise InvalidRequest(f"{at}: only text blocks are supported here", param=at)
        pieces.append(_block_text(block, at))
    return "".join(pieces)


# Chat messages, and for each the names of its fields in the request
# (`field_table`): ``messages[1].content[0].tool_use_id``, not the chat
# message's ``messages[2].tool_call_id``.
Converted = tuple[list[Message], list[dict[str, str]]]


def _system(system: Any) -> Converted:
    if system is None:
        return [], []
    text = _texts(system, "system")
    return ([{"role": "system", "content": text}], [{"": "system"}]) if text else ([], [])


def _messages(raw: Any) -> Converted:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    converted: list[Message] = []
    fields: list[dict[str, str]] = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        role = message.get("role")
        content = message.get("content")
        if role == "user":
            user, user_fields = _user(content, where)
            converted += user
            fields += user_fields
        elif role == "assistant":
            answer, answer_fields = _assistant(content, where)
            converted.append(answer)
            fields.append(answer_fields)
        elif role == "system":
            # A system message within the conversation: Claude Code sends them,
            # and SGLang's and vLLM's Messages routes take them (role "system").
            converted.append({"role": "system", "content": _texts(content, f"{where}.content")})
            fields.append({"": where})
        else:
            raise InvalidRequest(
                f"{where}.role must be user, assistant or system", param=f"{where}.role"
            )
    return converted, fields


def _content_blocks(content: Any, where: str) -> list[Any]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}.content must be a string or a list of blocks", param=f"{where}.content"
        )
    return content


def _user(content: Any, where: str) -> Converted:
    tools: list[Message] = []
    fields: list[dict[str, str]] = []
    texts: list[str] = []
    for i, block in enumerate(_content_blocks(content, where)):
        at = f"{where}.content[{i}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(f"{at}.tool_use_id must be a string", param=at)
            is_error = block.get("is_error", False)
            if not isinstance(is_error, bool):
                raise InvalidRequest(f"{at}.is_error must be a boolean", param=at)
            result = block.get("content", "")
            text = _texts(result if result is not None else "", f"{at}.content")
            tools.append({"role": "tool", "tool_call_id": call_id, "content": text})
            fields.append({"": at, "tool_call_id": f"{at}.tool_use_id"})
        else:
            raise InvalidRequest(
                f"{at} of type {kind!r} is not supported in a user message: "
                "text and tool_result blocks are",
                param=at,
            )
    if texts or not tools:
        tools.append({"role": "user", "content": "".join(texts)})
        fields.append({"": where})
    return tools, fields


def _assistant(content: Any, where: str) -> tuple[Message, dict[str, str]]:
    fields = {"": where}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(_content_blocks(content, where)):
        at = f"{where}.content[{i}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "thinking":
            reasoning.append(_block_text(block, at, "thinking"))
        elif kind == "redacted_thinking":
            pass  # opaque: nothing a template could render
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise InvalidRequest(f"{at} needs a string id and name", param=at)
            if not isinstance(arguments, dict):
                raise InvalidRequest(f"{at}.input must be an object", param=at)
            fields[f"tool_calls[{len(calls)}]"] = at
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
                }
            )
        else:
            raise InvalidRequest(
                f"{at} of type {kind!r} is not supported in an assistant message: "
                "text, thinking and tool_use blocks are",
                param=at,
            )
    message: Message = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message, fields


def _tools(tools: Any) -> list[dict[str, Any]]:
    converted = []
    for i, tool in enumerate(tool_list(tools)):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise InvalidRequest(
                f"{at} of type {kind!r} is not supported: only custom tools (with an "
                "input_schema); server and client-defined Anthropic tools are not served",
                param=at,
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{at}.name must be a string", param=at)
        check_schema(schema, f"{at}.input_schema", required=True)
        # OpenAI's key order: the template renders the tools as JSON.
        function: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise InvalidRequest(f"{at}.description must be a string", param=at)
            function["description"] = description
        function["parameters"] = schema
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        "tool_choice must be {'type': 'auto'|'any'|'none'} or {'type': 'tool', 'name': …}",
        param="tool_choice",
    )


def _stop_sequences(stops: Any) -> tuple[str, ...]:
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest(
            "stop_sequences must be a list of non-empty strings", param="stop_sequences"
        )
    return tuple(stops)


def _thinking(thinking: Any) -> bool | None:
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise InvalidRequest(
        "thinking must be {'type': 'enabled', …} or {'type': 'disabled'}", param="thinking"
    )


# --- the answer ---


def _stop_reason(choice: dict[str, Any], stops: tuple[str, ...]) -> tuple[str, str | None]:
    message = choice.get("message") or {}
    if message.get("tool_calls"):
        return "tool_use", None
    reason = choice.get("finish_reason")
    if reason == "length":
        return "max_tokens", None
    matched = choice.get("matched_stop")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def _input(arguments: Any) -> Any:
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    # Not a JSON object: what the model wrote, kept rather than lost.
    return {"arguments": arguments}


def render_message(answer: dict[str, Any], request: MessagesRequest) -> dict[str, Any]:
    """The worker's (validated) chat answer as an Anthropic Message."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": _input(function.get("arguments")),
            }
        )
    stop_reason, stop_sequence = _stop_reason(choice, request.stop_sequences)
    usage = answer.get("usage") or {}
    prompt = usage.get("prompt_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "id": f"msg_{answer.get('id', '')}",
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            # Anthropic counts cache reads apart from input_tokens.
            "input_tokens": max(prompt - cached, 0),
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": usage.get("completion_tokens") or 0,
        },
    }


def message_events(message: dict[str, Any]) -> bytes:
    """Anthropic's event stream for a complete `message`, after the fact (the
    turn was generated and committed whole, as on the chat route)."""
    events: list[dict[str, Any]] = []
    usage = message["usage"]
    started = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 0},
    }
    events.append({"type": "message_start", "message": started})
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "thinking":
            head: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": p} for p in text_pieces(block["thinking"])
            ]
        elif kind == "text":
            head = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in text_pieces(block["text"])]
        else:  # tool_use
            head = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            arguments = orjson.dumps(block["input"]).decode()
            deltas = [
                {"type": "input_json_delta", "partial_json": p} for p in text_pieces(arguments)
            ]
        events.append({"type": "content_block_start", "index": index, "content_block": head})
        for delta in deltas:
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": message["stop_reason"],
                "stop_sequence": message["stop_sequence"],
            },
            "usage": {"output_tokens": usage["output_tokens"]},
        }
    )
    events.append({"type": "message_stop"})
    return encode_typed_events(events)


# --- errors ---


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    """Anthropic's error document; `code` (the server's stable error code,
    docs/api.md#errors) rides along for clients that branch on it."""
    error: dict[str, Any] = {"type": error_type(status), "message": message}
    if code is not None:
        error["code"] = code
    return orjson.dumps({"type": "error", "error": error})


def error_of(exc: RolloutSessionError) -> bytes:
    return error_body(exc.status_code, exc.message, exc.code)


def worker_error_message(body: bytes) -> str:
    """The message of a worker's own error body (OpenAI's or SGLang's shape)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(doc.get("message"), str):
            return str(doc["message"])
    text = body[:2000].decode("utf-8", "replace").strip()
    return f"the worker answered with an error: {text}" if text else "the worker failed"
