"""Request parsing: what an agent may set."""

from __future__ import annotations

import orjson
import pytest

from rollout_session.errors import InvalidRequest
from rollout_session.turn.request import parse_chat_request

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
