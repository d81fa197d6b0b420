"""The compact stored conversation: exact round trips, the same history
matching as `messages.common_prefix`, and records the GC can forget."""

from __future__ import annotations

import gc
import sys
from typing import Any

import orjson
import pytest

from rollout_session.prompt.messages import assistant_message, common_prefix, normalize_messages
from rollout_session.session.conversation import Conversation, encode, record_bytes


def call(name: str, arguments: Any, call_id: str = "a") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATION = normalize_messages(
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "ü"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "think",
            "tool_calls": [call("f", '{"b": 2, "a": 1}')],
        },
        {"role": "tool", "content": "result", "tool_call_id": "a", "name": "f"},
        {"role": "assistant", "content": "done"},
    ]
)


def test_round_trip_keeps_values_and_key_order() -> None:
    stored = Conversation(CONVERSATION)
    assert stored.messages() == CONVERSATION
    assert [orjson.dumps(m) for m in stored.messages()] == [orjson.dumps(m) for m in CONVERSATION]
    assert stored.messages(3) == CONVERSATION[3:]
    # Any JSON object round-trips, not only normalised ones (journal, tests).
    odd: list[dict[str, Any]] = [
        {"role": "user", "content": "x", "extra": [1, 2.5, None]},
        {"role": "tool"},
    ]
    assert Conversation(odd).messages() == odd


@pytest.mark.parametrize(
    "incoming",
    [
        {"role": "assistant", "content": "", "tool_calls": [call("f", '{"a":1,"b":2}', "z")]},
        {"role": "assistant", "content": None, "tool_calls": [call("f", '{"a": 1.0, "b": 2}')]},
        {"role": "assistant", "content": None, "tool_calls": [call("f", '{"a": true, "b": 2}')]},
        {"role": "assistant", "content": None, "tool_calls": [call("f", '{"a": 2, "b": 2}')]},
        {"role": "assistant", "content": None, "tool_calls": [call("g", '{"a": 1, "b": 2}')]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "assistant", "tool_calls": [call("f", "{}")], "reasoning_content": "think"},
        {"role": "assistant", "reasoning_content": "other", "tool_calls": [call("f", "x")]},
        {"role": "user", "content": None},
    ],
)
def test_matching_is_messages_common_prefix(incoming: dict[str, Any]) -> None:
    """Same answer as the dict rules, including Python equality (1 == 1.0)."""
    stored = CONVERSATION[:3]
    [normalised] = normalize_messages([incoming])
    request = [*CONVERSATION[:2], normalised]
    assert Conversation(stored).common_prefix(request) == common_prefix(stored, request)


def test_matching_against_the_stored_answer() -> None:
    answer = assistant_message("", [call("f", '{"p": "x"}')], "thinking")
    echo = {"role": "assistant", "content": None, "tool_calls": [call("f", '{"p": "x"}', "c9")]}
    echoed = normalize_messages([echo])
    assert Conversation([answer]).common_prefix(echoed) == 1
    assert Conversation(CONVERSATION).common_prefix(CONVERSATION) == len(CONVERSATION)


def test_spliced_is_a_new_conversation() -> None:
    first = Conversation(CONVERSATION[:2])
    second = first.spliced(1, CONVERSATION[3:])
    assert first.messages() == CONVERSATION[:2]
    assert second.messages() == [CONVERSATION[0], *CONVERSATION[3:]]


def test_records_are_exact_sized_and_untracked_by_the_gc() -> None:
    stored = Conversation(CONVERSATION)
    gc.collect()  # untracks the records…
    gc.collect()  # …then the tuple holding them
    assert not gc.is_tracked(stored.records)
    assert not any(gc.is_tracked(r) for r in stored.records)
    for record in stored.records:
        rest = record[4]
        assert sys.getsizeof(rest) < len(rest) + 64  # not orjson's ~4 KiB buffer


@pytest.mark.parametrize(
    ("keep", "new"),
    [(5, CONVERSATION[:2]), (3, CONVERSATION[1:]), (0, CONVERSATION), (5, [])],
    ids=["extend", "replace-the-tail", "from-scratch", "nothing-new"],
)
def test_text_bytes_follow_each_splice(keep: int, new: list[dict[str, Any]]) -> None:
    """Kept in O(new) by each splice, equal to measuring every record, and
    counting what no template renders (reasoning, names, call ids)."""
    stored = Conversation(CONVERSATION)
    assert stored.text_bytes == record_bytes(stored.records)
    assert stored.text_bytes > sum(len(m["content"] or "") for m in CONVERSATION) + len("think")
    encoded = encode(new)
    after = stored.spliced(keep, encoded=encoded)
    assert after.text_bytes == record_bytes(after.records) == stored.bytes_after(keep, encoded)
    assert after.messages() == [*CONVERSATION[:keep], *new]
    assert stored.spliced(keep, new).records == after.records  # encoded here, the same


def test_a_long_reasoning_is_counted_whole() -> None:
    reasoning = "x" * 1_000_000
    answer = assistant_message("ok", [], reasoning)
    assert Conversation([answer]).text_bytes >= 1_000_000


def _long_history() -> list[dict[str, Any]]:
    """Plain turns, with tool calls and reasoning every third answer."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for i in range(12):
        messages.append({"role": "user", "content": f"step {i}"})
        if i % 3 == 0:
            answer = assistant_message("", [call("f", f'{{"i": {i}}}', f"c{i}")], "why")
        else:
            answer = assistant_message(f"answer {i}", [], None)
        messages.append(answer)
    return normalize_messages(messages)


def _echo(message: dict[str, Any], change: str) -> dict[str, Any]:
    """How an agent might send a stored message back."""
    echoed = dict(message)
    if change == "content-none" and not echoed["content"]:
        echoed["content"] = None
    elif change == "reasoning-echoed" and "reasoning_content" in echoed:
        echoed["reasoning_content"] = echoed["reasoning_content"]
    elif change == "reasoning-changed" and "reasoning_content" in echoed:
        echoed["reasoning_content"] = "something else"
    elif change == "call-id-changed" and echoed.get("tool_calls"):
        echoed["tool_calls"] = [dict(c, id="other") for c in echoed["tool_calls"]]
    elif change == "arguments-as-float" and echoed.get("tool_calls"):
        echoed["tool_calls"] = [
            dict(
                c,
                function={"name": "f", "arguments": {"i": float(c["function"]["arguments"]["i"])}},
            )
            for c in echoed["tool_calls"]
        ]
    elif change == "arguments-as-text" and echoed.get("tool_calls"):
        echoed["tool_calls"] = [
            dict(
                c,
                function={
                    "name": "f",
                    "arguments": orjson.dumps(c["function"]["arguments"]).decode(),
                },
            )
            for c in echoed["tool_calls"]
        ]
    elif change == "content-changed" and echoed["content"]:
        echoed["content"] += "!"
    return echoed


@pytest.mark.parametrize(
    "change",
    [
        "none",
        "content-none",
        "reasoning-echoed",
        "reasoning-changed",
        "call-id-changed",
        "arguments-as-float",
        "arguments-as-text",
        "content-changed",
    ],
)
@pytest.mark.parametrize("at", [0, 1, 6, 7, 13, 24], ids=lambda at: f"from-{at}")
def test_matching_a_long_history_is_messages_common_prefix(change: str, at: int) -> None:
    """`messages.common_prefix`'s answer wherever a history starts to
    differ, through echoes that are still the same message (content None for
    "", reasoning sent back, other call ids, 1.0 for 1, text arguments)."""
    stored = _long_history()
    request = normalize_messages(
        [*stored[:at], *(_echo(m, change) for m in stored[at:]), *stored[:2]]
    )
    expected = common_prefix(stored, request)
    assert Conversation(stored).common_prefix(request) == expected
    assert Conversation(stored).common_prefix(request[:-3]) == common_prefix(stored, request[:-3])
    if change not in ("reasoning-changed", "content-changed") or at >= len(stored):
        assert expected == len(stored)
