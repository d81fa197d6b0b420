"""Message normalisation and the history comparison rules of docs/api.md#history-rules."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.errors import InvalidRequest
from rollout_session.prompt.messages import assistant_message, common_prefix, normalize_messages


def norm(*messages: dict[str, Any]) -> list[dict[str, Any]]:
    return normalize_messages(list(messages))


def call(name: str, arguments: Any, call_id: str = "a") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_text_parts_are_flattened() -> None:
    [message] = norm(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert message["content"] == "ab"


@pytest.mark.parametrize(
    ("stored", "incoming", "equal"),
    [
        ({"content": None}, {"content": ""}, True),
        ({"content": ""}, {"content": []}, True),
        ({"content": "a"}, {"content": "b"}, False),
        (
            {"tool_calls": [call("f", '{"a": 1, "b": 2}')]},
            {"tool_calls": [call("f", '{"b":2,"a":1}', "other")]},
            True,
        ),
        ({"tool_calls": [call("f", '{"a": 1}')]}, {"tool_calls": [call("g", '{"a": 1}')]}, False),
        ({"tool_calls": [call("f", '{"a": 1}')]}, {"tool_calls": [call("f", '{"a": 2}')]}, False),
        ({"tool_calls": []}, {"tool_calls": None}, True),
        ({"reasoning_content": "r"}, {}, True),
        ({"reasoning_content": "r"}, {"reasoning_content": "r"}, True),
        ({"reasoning_content": "r"}, {"reasoning_content": "s"}, False),
        ({"reasoning_content": None}, {"reasoning_content": ""}, True),
    ],
    ids=[
        "none-empty",
        "empty-list",
        "content",
        "args-order-ids",
        "name",
        "args",
        "calls-empty",
        "reasoning-dropped",
        "reasoning-same",
        "reasoning-differs",
        "reasoning-empty",
    ],
)
def test_assistant_comparison(
    stored: dict[str, Any], incoming: dict[str, Any], equal: bool
) -> None:
    a = norm({"role": "assistant", **stored})
    b = norm({"role": "assistant", **incoming})
    assert common_prefix(a, b) == int(equal)


def test_common_prefix_stops_at_first_difference() -> None:
    stored = norm(
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    )
    incoming = norm(
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "X"},
        {"role": "user", "content": "c"},
    )
    assert common_prefix(stored, incoming) == 2
    assert common_prefix(stored, stored[:1]) == 1


def test_stored_answer_matches_sdk_echo() -> None:
    stored = assistant_message("", [call("f", '{"p": "x"}')], "thinking")
    echoed = norm(
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [call("f", '{"p": "x"}', "call_9")],
        }
    )
    assert common_prefix([stored], echoed) == 1


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        "x",
        [1],
        [{"role": "user", "content": 1}],
        [{"content": "x"}],
        [{"role": ["user"], "content": "x"}],
        [{"role": {"user": 1}, "content": "x"}],
        [{"role": "assistant", "tool_calls": "x"}],
        [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
        [{"role": "tool", "content": "x", "tool_call_id": 3}],
        [{"role": "user", "content": "x", "name": 1}],
    ],
    ids=[
        "none",
        "empty",
        "str",
        "int-item",
        "int-content",
        "no-role",
        "role-list",
        "role-object",
        "calls-str",
        "call-no-name",
        "tool-id-int",
        "name-int",
    ],
)
def test_invalid_messages(raw: Any) -> None:
    with pytest.raises(InvalidRequest):
        normalize_messages(raw)
