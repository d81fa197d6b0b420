"""`stream: true`: the SSE built from a complete answer, and the route around it.

Unit tests drive the pure chunk builder; the HTTP tests check that a streamed
turn commits exactly what a non-streamed one does, that errors stay JSON, and
that an agent that leaves mid-stream loses nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import orjson
import pytest
import trio

from rollout_session.emulator.worker import EmulatorConfig
from rollout_session.http.protocols.sse import (
    LOGPROB_ENTRIES,
    encode_events,
    sse_body,
    stream_chunks,
)
from rollout_session.turn.request import StreamMode, parse_chat_request
from tests.conftest import TOOLS, Stack, StackFactory
from tests.integration.session.test_turns import check_document, echo

USER = [{"role": "user", "content": "hello"}]

ANSWER: dict[str, Any] = {
    "id": "req-1",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "the answer is here",
                "reasoning_content": "think first",
            },
            "finish_reason": "stop",
            "meta_info": {"completion_tokens": 5},
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
}
TOOL_MESSAGE: dict[str, Any] = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": {"y": 2}}},
    ],
}


def with_message(message: dict[str, Any], **choice: Any) -> dict[str, Any]:
    answer = copy.deepcopy(ANSWER)
    answer["choices"][0].update(message=message, **choice)
    return answer


def parse_sse(data: bytes) -> list[dict[str, Any]]:
    """Chunks of an SSE body; asserts the framing and the final [DONE]."""
    assert data.endswith(b"\n\n")
    events = data[:-2].split(b"\n\n")
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") for e in events)
    return [orjson.loads(e[len(b"data: ") :]) for e in events[:-1]]


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client rebuilds from the deltas (as the SDKs do)."""
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["role"] = delta.get("role", message.get("role"))
            for key in ("content", "reasoning_content"):
                message[key] += delta.get(key) or ""
            for call in delta.get("tool_calls") or []:
                calls = message["tool_calls"]
                if call["index"] == len(calls):
                    calls.append({"id": call["id"], "type": call["type"], "function": {}})
                function = calls[call["index"]]["function"]
                for key, value in call["function"].items():
                    function[key] = function.get(key, "") + value
            if choice["finish_reason"] is not None:
                message["finish_reason"] = choice["finish_reason"]
    return message


# -- the chunk builder -------------------------------------------------------


@pytest.mark.parametrize("piece_chars", [1, 4, 1024], ids=["1-char", "4-chars", "default"])
def test_text_and_reasoning_chunks_rebuild_the_message(piece_chars: int) -> None:
    chunks = stream_chunks(ANSWER, StreamMode(), piece_chars=piece_chars)
    first = chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert first["finish_reason"] is None
    for chunk in chunks:
        assert (chunk["id"], chunk["created"], chunk["model"]) == ("req-1", 1700000000, "m")
        assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
    deltas = [c["choices"][0]["delta"] for c in chunks]
    # Reasoning comes before the answer, each piece at most piece_chars long.
    kinds = [next(iter(d)) for d in deltas[1:-1]]
    assert kinds == sorted(kinds, key=["reasoning_content", "content"].index)
    assert all(len(next(iter(d.values()))) <= piece_chars for d in deltas[1:-1])
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    rebuilt = accumulate(chunks)
    assert rebuilt["content"] == "the answer is here"
    assert rebuilt["reasoning_content"] == "think first"


def test_tool_calls_stream_header_then_arguments() -> None:
    answer = with_message(TOOL_MESSAGE, finish_reason="tool_calls")
    chunks = stream_chunks(answer, StreamMode(), piece_chars=3)
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:-1]]
    assert calls[0] == {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert calls[1] == {"index": 0, "function": {"arguments": '{"x'}}
    assert [c["index"] for c in calls] == sorted(c["index"] for c in calls)
    rebuilt = accumulate(chunks)
    assert rebuilt["content"] == "" and rebuilt["finish_reason"] == "tool_calls"
    assert rebuilt["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        # An object from the worker is sent as the JSON string clients expect.
        {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"y":2}'}},
    ]


def test_usage_chunk_when_asked() -> None:
    chunks = stream_chunks(ANSWER, StreamMode(include_usage=True))
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == ANSWER["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("asked", [False, True], ids=["not-asked", "asked"])
def test_logprobs_streamed_only_when_asked(asked: bool) -> None:
    entries = [{"token": str(i), "logprob": -0.5, "top_logprobs": []} for i in range(40)]
    answer = with_message(ANSWER["choices"][0]["message"], logprobs={"content": entries})
    chunks = stream_chunks(answer, StreamMode(logprobs=asked))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    if not asked:
        assert streamed == []
        return
    assert [e for lp in streamed for e in lp["content"]] == entries
    assert max(len(lp["content"]) for lp in streamed) == LOGPROB_ENTRIES


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"finish_reason": "length"}, "length"),
        ({"finish_reason": None, "meta_info": {"finish_reason": {"type": "abort"}}}, "abort"),
        ({"finish_reason": None, "meta_info": {}}, "stop"),
    ],
    ids=["choice", "meta-info", "default"],
)
def test_finish_reason_sources(choice: dict[str, Any], expected: str) -> None:
    answer = with_message(ANSWER["choices"][0]["message"], **choice)
    assert stream_chunks(answer, StreamMode())[-1]["choices"][0]["finish_reason"] == expected


def test_sse_framing_round_trips() -> None:
    body = sse_body(orjson.dumps(ANSWER), StreamMode(include_usage=True))
    assert parse_sse(body) == stream_chunks(ANSWER, StreamMode(include_usage=True))
    assert encode_events([]) == b"data: [DONE]\n\n"


# -- the stream mode of a request ---------------------------------------------

MODES: list[tuple[str, dict[str, Any], StreamMode | None]] = [
    ("absent", {}, None),
    ("false", {"stream": False, "stream_options": {"include_usage": True}}, None),
    ("plain", {"stream": True}, StreamMode()),
    ("usage", {"stream": True, "stream_options": {"include_usage": True}}, StreamMode(True)),
    ("usage-null", {"stream": True, "stream_options": {"include_usage": None}}, StreamMode()),
    ("logprobs", {"stream": True, "logprobs": True}, StreamMode(logprobs=True)),
    ("extra-option", {"stream": True, "stream_options": {"x": 1}}, StreamMode()),
]


@pytest.mark.parametrize(("fields", "expected"), [p[1:] for p in MODES], ids=[p[0] for p in MODES])
def test_stream_mode_of_a_request(fields: dict[str, Any], expected: Any) -> None:
    body = orjson.dumps({"messages": USER, **fields})
    assert parse_chat_request(body).stream_mode == expected


BAD_STREAM: list[tuple[str, dict[str, Any]]] = [
    ("stream-str", {"stream": "yes"}),
    ("stream-null", {"stream": None}),
    ("options-list", {"stream": True, "stream_options": [True]}),
    ("include-usage-str", {"stream": True, "stream_options": {"include_usage": "yes"}}),
    ("n-2", {"stream": True, "n": 2}),
]


@pytest.mark.parametrize("fields", [b[1] for b in BAD_STREAM], ids=[b[0] for b in BAD_STREAM])
async def test_bad_stream_request_is_json_400(stack: Stack, fields: dict[str, Any]) -> None:
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER, **fields)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "invalid_request"
    assert stack.emulator.received == 0


# -- over HTTP ---------------------------------------------------------------


async def tool_conversation(stack: Stack, session_id: str, **extra: Any) -> list[Any]:
    """user → tool call → tool result → answer; returns the assistant messages."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in main.py?"}]
    answers = []
    for seed in (1, 2):
        response = await stack.chat(session_id, messages=messages, tools=TOOLS, seed=seed, **extra)
        assert response.status_code == 200, response.text
        if extra.get("stream"):
            assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert response.headers["cache-control"] == "no-cache"
            assert response.headers["x-accel-buffering"] == "no"
            message = accumulate(parse_sse(response.content))
        else:
            message = response.json()["choices"][0]["message"]
        answers.append(message)
        messages.append(echo(message))
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "print(1)"})
    return answers


async def test_streamed_turns_commit_what_plain_turns_commit(stack: Stack) -> None:
    plain, streamed = await stack.create(), await stack.create()
    plain_answers = await tool_conversation(stack, plain)
    streamed_answers = await tool_conversation(
        stack, streamed, stream=True, stream_options={"include_usage": True}
    )
    assert plain_answers[0]["tool_calls"] and plain_answers[1]["content"]
    for want, got in zip(plain_answers, streamed_answers, strict=True):
        assert got["content"] == want["content"]
        assert got["tool_calls"] == [
            {k: c[k] for k in ("id", "type", "function")} for c in want.get("tool_calls", [])
        ]
    docs = [await stack.trajectory(s) for s in (plain, streamed)]
    check_document(docs[1])
    keys = ("token_ids", "loss_mask", "logprobs", "messages")
    assert [docs[0][k] for k in keys] == [docs[1][k] for k in keys]
    # The worker is always asked non-streaming, without stream_options.
    for record in stack.emulator.requests:
        assert record.body["stream"] is False and "stream_options" not in record.body


@pytest.mark.parametrize("fault", ["http_400", "http_500"], ids=["worker-400", "worker-500"])
async def test_worker_error_stays_json_when_streaming(make_stack: StackFactory, fault: str) -> None:
    stack = await make_stack(emulator=EmulatorConfig(fault=fault))
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER, stream=True)
    assert response.status_code == int(fault[-3:])
    assert response.headers["content-type"] == "application/json"
    assert response.json()["object"] == "error"
    assert stack.ctx.registry.get(session_id).trajectory.turns == []


async def post_and_hang_up(base_url: str, path: str, body: dict[str, Any]) -> bytes:
    """An agent that reads the first SSE bytes, then closes its connection."""
    url = httpx.URL(base_url)
    port = url.port
    assert port is not None
    payload = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    received = b""
    async with await trio.open_tcp_stream(url.host, port) as stream:
        await stream.send_all(head.encode() + payload)
        while b"data: " not in received:
            data = await stream.receive_some(4096)
            assert data, "connection closed before the stream began"
            received += data
    return received


async def test_disconnect_mid_stream_keeps_the_turn_and_frees_the_slot(
    make_stack: StackFactory,
) -> None:
    # A long answer (~120 kB of SSE): the agent hangs up long before its end.
    stack = await make_stack(emulator=EmulatorConfig(completion_tokens=20000))
    session_id = await stack.create()
    path = f"/sessions/{session_id}/v1/chat/completions"
    head = await post_and_hang_up(stack.url, path, {"messages": USER, "stream": True})
    assert head.startswith(b"HTTP/1.1 200")
    # The turn was generated before the first byte went out: it is committed.
    session = stack.ctx.registry.get(session_id)
    assert session.slot is None
    doc = await stack.trajectory(session_id)
    assert len(doc["turns"]) == 1
    assert doc["turns"][0]["completion_end"] - doc["turns"][0]["completion_start"] == 20000
    messages = [*USER, echo(doc["messages"][-1]), {"role": "user", "content": "more"}]
    response = await stack.chat(session_id, messages=messages, stream=True)
    assert response.status_code == 200
    assert len((await stack.trajectory(session_id))["turns"]) == 2
