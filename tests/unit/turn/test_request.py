"""Request parsing: what an agent may set."""

from __future__ import annotations

import orjson
import pytest

from rollout_session.errors import InvalidRequest
from rollout_session.turn.request import MAX_ARGUMENT_DEPTH, count_items, parse_chat_request

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "kwargs",
    [{"chat_template": "{{ 1 }}"}, {"tools": []}, {"add_generation_prompt": False},
     {"raise_exception": "x"}, {"strftime_now": "2020-01-01"}],
    ids=["chat_template", "tools", "add_generation_prompt", "raise_exception", "strftime_now"],
)  # fmt: skip
def test_template_kwargs_may_not_replace_the_servers_arguments(kwargs: dict[str, object]) -> None:
    body = orjson.dumps({"messages": USER, "chat_template_kwargs": kwargs})
    with pytest.raises(InvalidRequest, match="chat_template_kwargs may not set") as caught:
        parse_chat_request(body)
    assert caught.value.param == "chat_template_kwargs"


def test_template_kwargs_of_a_template_pass() -> None:
    body = orjson.dumps({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert parse_chat_request(body).chat_template_kwargs == {"enable_thinking": False}


TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}

REFUSED = [
    ("parameters-string", {"tools": [{**TOOL, "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ("parameters-list", {"tools": [{**TOOL, "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ("required-no-tools", {"tool_choice": "required"}, "tool_choice"),
    ("named-no-tools", {"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("named-unknown", {"tools": [TOOL], "tool_choice": {"function": {"name": "f"}}},
     "tool_choice"),
    ("named-no-function", {"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
    ("choice-unknown-string", {"tools": [TOOL], "tool_choice": "any"}, "tool_choice"),
    ("choice-int", {"tool_choice": 1}, "tool_choice"),
    ("top-logprobs-no-logprobs", {"top_logprobs": 5}, "top_logprobs"),
    ("top-logprobs-logprobs-false", {"top_logprobs": 5, "logprobs": False}, "top_logprobs"),
    ("unanswered-call", {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}, *USER]},
     "messages[1].tool_calls[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_naming_the_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_chat_request(orjson.dumps({"messages": USER, **fields}))
    assert refused.value.param == param


ACCEPTED = [
    ("parameters-absent", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("parameters-null", {"tools": [{**TOOL, "function": {"name": "f", "parameters": None}}]}),
    ("auto-no-tools", {"tool_choice": "auto"}),
    ("none-no-tools", {"tool_choice": "none"}),
    ("required", {"tools": [TOOL], "tool_choice": "required"}),
    ("named", {"tools": [TOOL], "tool_choice": {"type": "function",
                                                "function": {"name": "read_file"}}}),
    ("top-logprobs-with-logprobs", {"top_logprobs": 5, "logprobs": True}),
    ("top-logprobs-0", {"top_logprobs": 0}),
    # Engine extras agents send with extra_body: forwarded as they are.
    ("engine-extras", {"top_k": 20, "min_p": 0.1, "separate_reasoning": False,
                       "chat_template_kwargs": {"enable_thinking": False},
                       "repetition_penalty": 1.1}),
]  # fmt: skip


@pytest.mark.parametrize("fields", [a[1] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_accepted_and_forwarded(fields: dict[str, object]) -> None:
    request = parse_chat_request(orjson.dumps({"messages": USER, **fields}))
    assert {k: request.raw[k] for k in fields} == fields


# -- counted before anything is built ------------------------------------------

TINY = {"role": "user", "content": "a"}
CALL = {"function": {"name": "f", "arguments": "{}"}}

COUNTED: dict[str, tuple[dict[str, object], str, str]] = {
    "messages": ({"messages": [TINY] * 11}, "messages", "holds 11 messages"),
    "input-items": ({"input": [TINY] * 11}, "input", "holds 11 messages"),
    "content-parts": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 11}]},
        "messages",
        "holds 11 content parts and tool calls",
    ),
    "tool-calls": (
        {"messages": [TINY, {"role": "assistant", "tool_calls": [CALL] * 6}] * 2},
        "messages",
        "holds 12 content parts and tool calls",
    ),
    "tools": ({"messages": [TINY], "tools": [{"type": "function"}] * 11}, "tools", "11 tools"),
}


@pytest.mark.parametrize(("body", "param", "said"), COUNTED.values(), ids=COUNTED.keys())
def test_a_body_over_the_limit_is_counted_and_refused(
    body: dict[str, object], param: str, said: str
) -> None:
    with pytest.raises(InvalidRequest, match=said) as refused:
        count_items(orjson.dumps(body), 10)
    assert refused.value.param == param
    assert "(--max-messages)" in refused.value.message


PASSED: dict[str, bytes] = {
    "at-the-limit": orjson.dumps({"messages": [TINY] * 10, "tools": [{}] * 10}),
    # Each counted element is an object: fewer braces than the limit is not decoded.
    "few-objects": orjson.dumps({"messages": [TINY], "metadata": list(range(100))}),
    "input-a-string": orjson.dumps({"input": "hi", "x": [{}] * 20}),
    # Other shapes are the route's to refuse, for their first defect.
    "not-json": b'{"messages": [' + b"{}," * 20 + b"",
    "elements-not-objects": orjson.dumps({"messages": [1, {}, {}] * 10}),
    "content-an-object": orjson.dumps({"messages": [{"content": {}}] * 20}),
}


@pytest.mark.parametrize("body", PASSED.values(), ids=PASSED.keys())
def test_a_body_within_the_limit_or_of_other_shapes_passes(body: bytes) -> None:
    count_items(body, 10)


def test_counting_builds_no_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """437k tiny messages (15 MB): refused for their number before any
    message is built — the JSON parse the route would run is never called."""
    body = orjson.dumps({"messages": [TINY] * 437_000})

    def no_parse(_body: bytes) -> None:
        raise AssertionError("the body was parsed")

    monkeypatch.setattr(orjson, "loads", no_parse)
    with pytest.raises(InvalidRequest, match="holds 437000 messages"):
        count_items(body, 10_000)


# -- how deep tool-call arguments nest -------------------------------------------


def nested(depth: int, *, open_: str = '{"a": ', close: str = "}") -> str:
    return open_ * depth + "1" + close * depth


def with_arguments(arguments: object) -> dict[str, object]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
    }


DEPTHS: dict[str, tuple[object, bool]] = {
    "string-at-the-limit": (nested(MAX_ARGUMENT_DEPTH), False),
    "string-past-it": (nested(MAX_ARGUMENT_DEPTH + 1), True),
    "string-past-orjson": (nested(5000), True),
    "lists-past-it": (nested(MAX_ARGUMENT_DEPTH + 1, open_="[", close="]"), True),
    "object-at-the-limit": (orjson.loads(nested(MAX_ARGUMENT_DEPTH)), False),
    "object-past-it": (orjson.loads(nested(MAX_ARGUMENT_DEPTH + 1)), True),
    "brackets-in-strings": ('{"a": "' + "{[" * 500 + '"}', False),
    "escaped-quotes": ('{"a": "\\"' + "[" * 500 + '\\""}', False),
    "not-json-but-deep": ("[" * 1000, True),
    "many-shallow": ("[" + "[1]," * 1000 + "1]", False),
}


@pytest.mark.parametrize(("arguments", "refused"), DEPTHS.values(), ids=DEPTHS.keys())
def test_tool_call_arguments_nest_at_most_the_limit(arguments: object, refused: bool) -> None:
    body = orjson.dumps(with_arguments(arguments))
    if not refused:
        parse_chat_request(body)
        return
    with pytest.raises(InvalidRequest, match=f"deeper than {MAX_ARGUMENT_DEPTH}") as raised:
        parse_chat_request(body)
    assert raised.value.param == "messages[1].tool_calls[0].function.arguments"
