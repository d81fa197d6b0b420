"""The Messages conversion (anthropic_messages.py): requests become the chat
request a chat client would send, answers go back as Messages, and an
answer sent back as blocks converts to the message the session stored."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from rollout_session.errors import InvalidRequest
from rollout_session.http.protocols.messages_codec import (
    error_body,
    message_events,
    parse_messages_request,
    render_message,
)
from rollout_session.prompt.messages import common_prefix, normalize_messages

ANSWER: dict[str, Any] = {
    "id": "abc",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "matched_stop": None,
            "message": {
                "role": "assistant",
                "reasoning_content": "think",
                "content": "I will read it.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                    }
                ],
            },
        }
    ],
    "usage": {
        "prompt_tokens": 20,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 16},
    },
}


def request(**fields: Any) -> bytes:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return orjson.dumps({**body, **fields})


def test_an_answer_sent_back_as_blocks_is_the_stored_message() -> None:
    parsed = parse_messages_request(request())
    message = render_message(ANSWER, parsed)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"]["input_tokens"] == 4
    assert message["usage"]["cache_read_input_tokens"] == 16
    echoed = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": message["content"]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "x"},
                {"type": "text", "text": "go on"},
            ],
        },
    ]
    chat = parse_messages_request(request(messages=echoed)).chat["messages"]
    stored = normalize_messages(
        [{"role": "user", "content": "hi"}, ANSWER["choices"][0]["message"]]
    )
    assert common_prefix(stored, normalize_messages(chat)) == 2
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "user"]
    assert chat[2] == {"role": "tool", "tool_call_id": "call_1", "content": "x"}


def test_the_chat_request() -> None:
    chat = parse_messages_request(
        request(
            system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            tools=[{"name": "t", "description": "d", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "t"},
            stop_sequences=["END"],
            thinking={"type": "disabled"},
            temperature=0.5,
            top_k=5,
            metadata={"user_id": "u"},
            seed=3,
        )
    ).chat
    assert chat == {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "hi"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "t", "description": "d", "parameters": {"type": "object"}},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "t"}},
        "stop": ["END"],
        "chat_template_kwargs": {"enable_thinking": False},
        "temperature": 0.5,
        "top_k": 5,
        "seed": 3,
        "stream": False,
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"finish_reason": "length"}, ("max_tokens", None)),
        ({"finish_reason": "stop", "matched_stop": "END"}, ("stop_sequence", "END")),
        ({"finish_reason": "stop", "matched_stop": 2}, ("end_turn", None)),
    ],
    ids=["length", "stop-sequence", "eos"],
)
def test_stop_reasons(choice: dict[str, Any], expected: tuple[str, str | None]) -> None:
    answer = {**ANSWER, "choices": [{"message": {"content": "x"}, **choice}]}
    message = render_message(answer, parse_messages_request(request(stop_sequences=["END"])))
    assert (message["stop_reason"], message["stop_sequence"]) == expected


def test_the_events_rebuild_the_message() -> None:
    message = render_message(ANSWER, parse_messages_request(request()))
    frames = [f for f in message_events(message).decode().split("\n\n") if f]
    events = [orjson.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
    rebuilt: list[dict[str, Any]] = []
    for event in events:
        if event["type"] == "content_block_start":
            rebuilt.append(dict(event["content_block"]))
            rebuilt[-1].pop("input", None)
        elif event["type"] == "content_block_delta":
            block, delta = rebuilt[event["index"]], event["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
            if key is None:
                block["json"] = block.get("json", "") + delta["partial_json"]
            else:
                block[key] += delta[key]
    rebuilt[2]["input"] = orjson.loads(rebuilt[2].pop("json"))
    assert rebuilt == message["content"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-1] == {"type": "message_stop"}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (502, "api_error"),
    ],
    ids=["400", "404", "409", "413", "429", "502"],
)
def test_error_types(status: int, kind: str) -> None:
    assert orjson.loads(error_body(status, "m")) == {
        "type": "error",
        "error": {"type": kind, "message": "m"},
    }


def test_count_tokens_needs_no_max_tokens() -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert "max_tokens" not in parse_messages_request(body, count_only=True).chat
    with pytest.raises(InvalidRequest):
        parse_messages_request(body)


def test_what_claude_code_sends() -> None:
    """Claude Code 2.1: a system message within the conversation, cache_control
    on blocks, adaptive thinking, Anthropic-only settings (dropped)."""
    body = request(
        system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}]},
            {"role": "system", "content": "agents: …"},
            {"role": "user", "content": [{"type": "text", "text": "b", "cache_control": {}}]},
        ],
        thinking={"type": "adaptive"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        metadata={"user_id": "u"},
    )
    chat = parse_messages_request(body).chat
    assert chat["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "system", "content": "agents: …"},
        {"role": "user", "content": "b"},
    ]
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert not {"context_management", "output_config", "metadata"} & set(chat)


def test_arguments_that_are_no_object_are_kept_and_do_not_match() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2"}}
    reply = {"role": "assistant", "content": "", "tool_calls": [call]}
    answer = {**ANSWER, "choices": [{"message": reply}]}
    message = render_message(answer, parse_messages_request(request()))
    assert message["content"][0]["input"] == {"arguments": "[1, 2"}
    echoed = [
        *orjson.loads(request())["messages"],
        {"role": "assistant", "content": message["content"]},
    ]
    chat = parse_messages_request(request(messages=echoed)).chat["messages"]
    stored = normalize_messages(
        [{"role": "user", "content": "hi"}, answer["choices"][0]["message"]]
    )
    assert common_prefix(stored, normalize_messages(chat)) == 1  # a new segment, said so
