"""The agent-facing request: parsing and checking an OpenAI chat request.

Everything is checked before a worker is involved, so a bad request costs no
GPU time and never touches the session's trajectory. Fields we do not know are
kept and forwarded (agents pass SGLang extras such as ``top_k`` via
``extra_body``); fields the server owns are overwritten when forwarding.

What a body may hold beyond its size (docs/security.md#request-bodies):

- **Its collections, counted before anything is built** (`count_items`, run
  by the HTTP edge on the model routes before any protocol parses the body):
  at most ``--max-messages`` messages (a Responses request's ``input``
  items), as many content parts and tool calls over all of them, and as many
  tools. A body of 437k tiny messages used to be parsed whole, each message
  normalised, rendered and tokenised, before its 400: seconds of CPU and
  hundreds of MB for 15 MB. Counting takes one pass of msgspec over the
  bytes, skipping every value but those lists' elements, each held as an
  empty object; the limit is known before any message exists.
- **Tool-call arguments nested at most `MAX_ARGUMENT_DEPTH` deep**, as an
  object or as a JSON string (`check_argument_depth`): the workers parse
  them again (SGLang's and vLLM's tool parsers and templates with Python's
  ``json``, whose recursion stops near 1,000 levels less the stack in use),
  and a string 5,000 levels deep, which this server's own orjson parse
  refuses (orjson stops at 1,024 levels and a request body deeper than that
  is a 400 here), was forwarded as text and crashed the worker's parse.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import orjson

from ..errors import InvalidRequest
from ..prompt.messages import Message, check_conversation, normalize_messages

__all__ = [
    "MAX_ARGUMENT_DEPTH",
    "ChatRequest",
    "StreamMode",
    "chat_request",
    "check_argument_depth",
    "check_int",
    "check_schema",
    "count_items",
    "parse_chat_request",
    "parse_json_object",
    "tool_list",
]

# How deep tool-call arguments may nest. Deeper than any tool's arguments
# (a few levels), and well within every JSON parser on their way: serde_json
# (Rust: sgl-model-gateway) stops at 128 for a whole body, Python's json
# (the engines' tool parsers) near 1,000 less its stack, orjson at 1,024.
MAX_ARGUMENT_DEPTH: Final = 64


# -- counting a body's collections before building anything ------------------


class _Element(msgspec.Struct, gc=False):
    """An element of a counted list: an object, every field skipped."""


class _Item(msgspec.Struct, gc=False):
    """A message (an ``input`` item, an Anthropic message): the lists it
    holds, counted; every other field skipped."""

    content: str | list[_Element] | None = None
    tool_calls: list[_Element] | None = None


class _Counted(msgspec.Struct, gc=False):
    """A model route's body as far as counting goes: the message lists of
    the chat and Messages APIs (``messages``) and of the Responses API
    (``input``), and the tools."""

    messages: list[_Item] | None = None
    input: str | list[_Item] | None = None
    tools: list[_Element] | None = None


_COUNTED_DECODER: Final = msgspec.json.Decoder(_Counted)


def count_items(body: bytes, limit: int) -> None:
    """400 for a model route's body holding more than `limit` messages (a
    Responses request's ``input`` items), content parts and tool calls over
    all of them, or tools, counted before any of them is built: msgspec
    skips every other value, and holds each counted element as an empty
    object (16 bytes). A body with fewer objects than `limit` (most are) is
    not even decoded. A body whose lists are of other shapes (not JSON, an
    element that is no object, ...) is left to the route's own parse, which
    refuses it for its first defect."""
    if body.count(b"{") <= limit:  # every counted element is an object
        return
    try:
        counted = _COUNTED_DECODER.decode(body)
    except msgspec.MsgspecError:
        return
    items = counted.messages if counted.messages is not None else counted.input
    if isinstance(items, list):
        field = "messages" if counted.messages is not None else "input"
        if len(items) > limit:
            raise InvalidRequest(
                f"{field} holds {len(items)} messages; a request may carry at most {limit} "
                "(--max-messages)",
                param=field,
            )
        parts = sum(
            (len(item.content) if isinstance(item.content, list) else 0)
            + len(item.tool_calls or ())
            for item in items
        )
        if parts > limit:
            raise InvalidRequest(
                f"{field} holds {parts} content parts and tool calls; a request may carry "
                f"at most {limit} (--max-messages)",
                param=field,
            )
    if counted.tools is not None and len(counted.tools) > limit:
        raise InvalidRequest(
            f"tools holds {len(counted.tools)} tools; a request may carry at most {limit} "
            "(--max-messages)",
            param="tools",
        )


# -- how deep tool-call arguments nest -----------------------------------------

# A JSON string literal (unrolled: no backtracking), and what is not a bracket.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP: Final = {"[": 1, "{": 1, "]": -1, "}": -1}


def _text_depth(text: str) -> int:
    """How deep the JSON (or JSON-like) `text` nests: brackets outside its
    string literals, counted at C speed (no recursion, whatever the depth)."""
    if text.count("[") + text.count("{") <= MAX_ARGUMENT_DEPTH:
        return 0  # cannot be deeper (the usual case: nothing more is done)
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_argument_depth(messages: Any) -> None:
    """400 for a tool call (in raw chat `messages`) whose arguments, an
    object or a JSON string, nest deeper than `MAX_ARGUMENT_DEPTH`. Shapes
    other than the chat format's are left to `normalize_messages`."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(calls, list):
            continue
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            arguments = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(arguments, dict | list):
                arguments = orjson.dumps(arguments).decode()
            if isinstance(arguments, str) and _text_depth(arguments) > MAX_ARGUMENT_DEPTH:
                at = f"messages[{i}].tool_calls[{k}].function.arguments"
                raise InvalidRequest(
                    f"{at} nests deeper than {MAX_ARGUMENT_DEPTH} levels: tool-call "
                    "arguments may nest at most that deep",
                    param=at,
                )


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
    check_argument_depth(raw.get("messages"))
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
