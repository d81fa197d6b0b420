"""Message normalisation, the history comparison rules of
docs/api.md#history-rules, and what a conversation must hold
(docs/api.md#what-a-conversation-must-hold)."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.errors import InvalidRequest
from rollout_session.prompt.messages import (
    assistant_message,
    check_conversation,
    common_prefix,
    field_table,
    normalize_messages,
)


def norm(*messages: dict[str, Any]) -> list[dict[str, Any]]:
    return normalize_messages(list(messages))


def call(name: str, arguments: Any, call_id: str | None = "a") -> dict[str, Any]:
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


USER = {"role": "user", "content": "hi"}


def answer(*ids: str | None, content: Any = None) -> dict[str, Any]:
    """An answer calling read_file once per id."""
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [call("read_file", "{}", i) for i in ids],
    }


def result(call_id: str | None = None, content: Any = "x") -> dict[str, Any]:
    message = {"role": "tool", "content": content}
    return message if call_id is None else {**message, "tool_call_id": call_id}


REFUSED = [
    ("user-no-content", [{"role": "user"}], "messages[0].content"),
    ("user-null-content", [{"role": "user", "content": None}], "messages[0].content"),
    ("system-null-content", [{"role": "system", "content": None}, USER], "messages[0].content"),
    ("developer-no-content", [{"role": "developer"}, USER], "messages[0].content"),
    ("assistant-nothing", [USER, {"role": "assistant"}, USER], "messages[1].content"),
    ("assistant-null-no-calls", [USER, answer(), USER], "messages[1].content"),
    ("tool-first", [USER, result()], "messages[1].tool_call_id"),
    ("tool-after-plain-answer", [USER, answer(content="hi"), result("a")],
     "messages[2].tool_call_id"),
    ("tool-unknown-id", [USER, answer("a", "b"), result("c")], "messages[2].tool_call_id"),
    ("result-after-user", [USER, answer("a"), USER, result("a")], "messages[1].tool_calls[0]"),
    ("unanswered-before-user", [USER, answer("a"), USER], "messages[1].tool_calls[0]"),
    ("one-unanswered", [USER, answer("a", "b"), result("a"), USER], "messages[1].tool_calls[1]"),
    ("answered-twice", [USER, answer("a", "b"), result("a"), result("a"), USER],
     "messages[1].tool_calls[1]"),
    ("in-order-unanswered", [USER, answer("a", "b"), result(), USER], "messages[1].tool_calls[1]"),
    ("unanswered-before-answer", [USER, answer("a"), answer(content="x")],
     "messages[1].tool_calls[0]"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("messages", "param"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_conversations_no_model_was_asked_are_refused(
    messages: list[dict[str, Any]], param: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_conversation(norm(*messages))
    assert refused.value.param == param
    assert refused.value.message.startswith(f"{param}: ")


ACCEPTED = [
    ("empty-answer", [USER, answer(content=""), USER]),
    ("reasoning-only", [USER, {"role": "assistant", "reasoning_content": "hmm"}, USER]),
    ("user-empty-string", [{"role": "user", "content": ""}]),
    ("tool-null-content", [USER, answer("a"), result("a", None), USER]),
    ("calls-answered-any-order", [USER, answer("a", "b"), result("b"), result("a"), USER]),
    ("results-without-ids", [USER, answer("a", "b"), result(), result(), USER]),
    ("calls-without-ids", [USER, answer(None), result("x"), USER]),
    ("system-between", [USER, answer("a"), {"role": "system", "content": "s"}, result("a"), USER]),
    # The history rules' business (an agent-written assistant message).
    ("ends-with-calls", [USER, answer("a")]),
    # As OpenAI's own snippets do: a request may answer one call of two.
    ("ends-partly-answered", [USER, answer("a", "b"), result("a")]),
]  # fmt: skip


@pytest.mark.parametrize("messages", [a[1] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_conversations_agents_send_pass(messages: list[dict[str, Any]]) -> None:
    check_conversation(norm(*messages))


def test_the_servers_own_empty_answer_passes_as_stored_and_as_echoed() -> None:
    """A model that sampled only its end token: the stored answer, and the
    SDK's echo of it (``model_dump(exclude_none=True)`` keeps content "")."""
    stored = assistant_message("", [], None)
    check_conversation([*norm(USER), stored, *norm(USER)])
    check_conversation(norm(USER, {"role": "assistant", "content": ""}, USER))


HISTORY = norm(USER, {"role": "assistant"}, USER, answer("a"))  # its defect is not the request's


@pytest.mark.parametrize(
    ("new", "param"),
    [
        ([result("a"), USER], None),
        ([result("b")], "messages[4].tool_call_id"),
        # The unanswered call is the history's: named where the request breaks it.
        ([USER], "messages[4]"),
    ],
    ids=["answers-the-history", "unknown-id", "unanswered-history-call"],
)
def test_a_stored_history_gives_the_calls_but_is_not_refused(
    new: list[dict[str, Any]], param: str | None
) -> None:
    messages = [*HISTORY, *norm(*new)]
    if param is None:
        check_conversation(messages, start=len(HISTORY))
        return
    with pytest.raises(InvalidRequest) as refused:
        check_conversation(messages, start=len(HISTORY))
    assert refused.value.param == param


def test_a_codec_names_fields_as_its_request_does() -> None:
    """`field_table`: the item a chat message came from, or its field."""
    names = [{"": "input[0]"}, {"": "input[1]", "tool_calls[0]": "input[2]"}, {"": "input[3]"}]
    with pytest.raises(InvalidRequest) as refused:
        check_conversation(norm(USER, answer("a"), USER), field=field_table(names))
    assert refused.value.param == "input[2]"
    offset = field_table([{"": "input[0]", "tool_call_id": "input[0].call_id"}], offset=2)
    with pytest.raises(InvalidRequest) as refused:
        check_conversation([*norm(USER, answer("a")), *norm(result("b"))], start=2, field=offset)
    assert refused.value.param == "input[0].call_id"
