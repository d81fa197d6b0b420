"""The agent-facing request: parsing and checking an OpenAI chat request.

Everything is checked before a worker is involved, so a bad request costs no
GPU time and never touches the session's trajectory. Fields we do not know are
kept and forwarded (agents pass SGLang extras such as ``top_k`` via
``extra_body``); fields the server owns are overwritten when forwarding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ..errors import InvalidRequest
from ..prompt.messages import Message, check_conversation, normalize_messages

__all__ = [
    "ChatRequest",
    "StreamMode",
    "chat_request",
    "check_int",
    "check_schema",
    "parse_chat_request",
    "parse_json_object",
    "tool_list",
]


@dataclass(frozen=True, slots=True)
class StreamMode:
    """What a ``stream: true`` request asks of its SSE answer."""

    include_usage: bool = False  # stream_options.include_usage: a final usage chunk
    logprobs: bool = False  # the agent asked for logprobs: stream them too


@dataclass(slots=True)
class ChatRequest:
    raw: dict[str, Any]
    messages: list[Message]
    tools: list[Any] | None
    chat_template_kwargs: dict[str, Any]
    max_tokens: int | None
    stream: bool
    stream_mode: StreamMode | None = None  # set exactly when stream is true


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _check_number(raw: dict[str, Any], name: str, low: float, high: float) -> None:
    value = raw.get(name)
    if value is None:
        return
    if not _is_number(value) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be a number in [{low}, {high}]", param=name)


def check_int(raw: dict[str, Any], name: str, low: int, high: int) -> int | None:
    """`raw[name]`: absent, or an integer in [low, high] (400 naming it)."""
    value = raw.get(name)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {high}]", param=name)
    return int(value)


def _check_type(raw: dict[str, Any], name: str, types: tuple[type, ...], what: str) -> None:
    # None of the accepted types is int, so bool (an int subclass) cannot sneak in.
    value = raw.get(name)
    if value is not None and not isinstance(value, types):
        raise InvalidRequest(f"{name} must be {what}", param=name)


def tool_list(tools: Any) -> list[Any]:
    """A request's `tools` in any protocol: [] when absent, else a list (400)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    return tools


def check_schema(schema: Any, at: str, *, required: bool = False) -> None:
    """A tool's parameter schema (`at` names it): a JSON object, or absent
    unless `required`. vLLM's FunctionDefinition (``dict | None``), SGLang's
    JSON-schema check (_validate_request) and Anthropic's ``input_schema``
    refuse anything else, and chat templates read its keys."""
    if not isinstance(schema, dict) and (required or schema is not None):
        raise InvalidRequest(f"{at} must be a JSON schema object", param=at)


def _check_tools(tools: Any) -> list[Any] | None:
    tools = tool_list(tools)
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param=f"tools[{i}]",
            )
        check_schema(fn.get("parameters"), f"tools[{i}].function.parameters")
    return tools or None


def _check_tool_choice(choice: Any, tools: list[Any] | None) -> None:
    """What SGLang's and vLLM's chat routes accept, so the worker is never
    asked for a call it cannot make: "none", "auto" (with or without tools:
    SGLang accepts it, and it asks for nothing), "required" with tools, or
    one of the tools by name."""
    if choice is None or choice in ("none", "auto"):
        return
    if choice != "required":
        fn = choice.get("function") if isinstance(choice, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(
                "tool_choice must be none, auto, required or "
                "{'type': 'function', 'function': {'name': ...}}",
                param="tool_choice",
            )
        names = [tool["function"]["name"] for tool in tools or ()]
        if fn["name"] not in names:
            raise InvalidRequest(
                f"tool_choice names {fn['name']!r}, which is none of the tools "
                f"({', '.join(map(repr, names)) or 'none are given'})",
                param="tool_choice",
            )
    elif not tools:
        raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")


def _check_stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("stop must be a string or a list of strings", param="stop")


def _check_stream_options(raw: dict[str, Any]) -> bool:
    """Validate ``stream_options``; return ``include_usage``.

    Accepted (and ignored) without ``stream: true``, unlike OpenAI: agent
    frameworks that always send it would otherwise fail every plain turn.
    Unknown keys are accepted for newer SDKs' options.
    """
    options = raw.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InvalidRequest(
            "stream_options.include_usage must be a boolean", param="stream_options.include_usage"
        )
    return bool(include_usage)


# What `apply_chat_template` takes as its own arguments, and the functions
# templates call: a request's kwargs may not replace them (vLLM refuses the
# first two likewise).
_RESERVED_TEMPLATE_KWARGS: Final = frozenset(
    {
        "chat_template",
        "tokenize",
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "raise_exception",
        "strftime_now",
    }
)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object (NaN/Infinity rejected)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def parse_chat_request(body: bytes) -> ChatRequest:
    """A chat completions request body, parsed and checked."""
    request = chat_request(parse_json_object(body))
    check_conversation(request.messages)
    return request


def chat_request(raw: dict[str, Any]) -> ChatRequest:
    """A chat completions request, checked: the chat route's body, or what
    another protocol (Responses, Messages) decoded its request into. Its
    conversation's structure is the caller's to check (`check_conversation`),
    naming the fields as its agent wrote them."""
    messages = normalize_messages(raw.get("messages"))
    n = raw.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise InvalidRequest("only n=1 is supported: a session is one trajectory", param="n")
    stream = raw.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    include_usage = _check_stream_options(raw)
    max_tokens = check_int(raw, "max_tokens", 1, 2**31 - 1)
    max_completion = check_int(raw, "max_completion_tokens", 1, 2**31 - 1)
    _check_number(raw, "temperature", 0.0, 2.0)
    _check_number(raw, "top_p", 0.0, 1.0)
    _check_number(raw, "presence_penalty", -2.0, 2.0)
    _check_number(raw, "frequency_penalty", -2.0, 2.0)
    check_int(raw, "seed", -(2**63), 2**64 - 1)
    top_logprobs = check_int(raw, "top_logprobs", 0, 20)
    if top_logprobs and raw.get("logprobs") is not True:
        # Refused by OpenAI and vLLM (check_logprobs); the worker is always
        # asked for logprobs, so it would otherwise answer what was not asked.
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    check_int(raw, "top_k", -1, 2**31 - 1)
    _check_stop(raw.get("stop"))
    _check_type(raw, "model", (str,), "a string")
    _check_type(raw, "user", (str,), "a string")
    _check_type(raw, "logprobs", (bool,), "a boolean")
    _check_type(raw, "parallel_tool_calls", (bool,), "a boolean")
    _check_type(raw, "response_format", (dict,), "an object")
    _check_type(raw, "metadata", (dict,), "an object")
    kwargs = raw.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server renders "
            "the prompt with its own",
            param="chat_template_kwargs",
        )
    tools = _check_tools(raw.get("tools"))
    _check_tool_choice(raw.get("tool_choice"), tools)
    return ChatRequest(
        raw=raw,
        messages=messages,
        tools=tools,
        chat_template_kwargs=kwargs,
        max_tokens=max_completion if max_completion is not None else max_tokens,
        stream=stream,
        stream_mode=StreamMode(include_usage, raw.get("logprobs") is True) if stream else None,
    )
