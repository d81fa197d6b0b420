"""The Anthropic Messages API on a session (docs/api.md#post-sessionsidv1messages),
through the official `anthropic` SDK: the same turns as chat completions,
errors in Anthropic's shape."""

from __future__ import annotations

from typing import Any

import anthropic
import orjson
import pytest
import trio
import trio.testing

from rollout_session.emulator import EmulatorConfig
from rollout_session.emulator.faults import FaultPicker
from tests.conftest import TOOLS, Stack, StackFactory
from tests.integration.conftest import closed_after_test
from tests.integration.protocols.test_sdk import MODEL
from tests.integration.session.test_turns import check_document, echo
from tests.loopback import TLS

pytestmark = pytest.mark.usefixtures("close_sdk_clients")

USER = "What does main.py print?"
MAX_TOKENS = 64
ANTHROPIC_TOOLS: Any = [
    {
        "name": tool["function"]["name"],  # type: ignore[index]
        "description": tool["function"]["description"],  # type: ignore[index]
        "input_schema": tool["function"]["parameters"],  # type: ignore[index]
    }
    for tool in TOOLS
]


def client(
    stack: Stack, session_id: str | None, *, api_key: str = "unused", **kwargs: Any
) -> anthropic.AsyncAnthropic:
    """The SDK pointed at a session: its base URL is the one the SDK appends
    ``/v1/messages`` to (ANTHROPIC_BASE_URL for Claude Code)."""
    base = stack.url if session_id is None else f"{stack.url}/sessions/{session_id}"
    return closed_after_test(
        anthropic.AsyncAnthropic(
            base_url=base,
            api_key=api_key,
            max_retries=0,
            **kwargs,
            http_client=anthropic.DefaultAsyncHttpxClient(verify=TLS),
        )
    )


def committed(doc: dict[str, Any]) -> tuple[Any, ...]:
    return (doc["token_ids"], doc["loss_mask"], doc["logprobs"], doc["num_segments"])


async def messages_episode(
    agent: anthropic.AsyncAnthropic, turns: int, *, stream: bool = False, thinking: bool = False
) -> list[anthropic.types.Message]:
    """A tool loop in the Messages API: each answer's blocks go back as the
    assistant message, its tool_use blocks answered by tool_result blocks."""
    messages: list[Any] = [{"role": "user", "content": USER}]
    answers: list[anthropic.types.Message] = []
    for i in range(turns):
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": MAX_TOKENS,
            "messages": messages,
            "tools": ANTHROPIC_TOOLS,
            "extra_body": {"seed": i},
        }
        if thinking:
            kwargs["thinking"] = {"type": "enabled", "budget_tokens": 1024}
        if stream:
            async with agent.messages.stream(**kwargs) as events:
                answer = await events.get_final_message()
        else:
            answer = await agent.messages.create(**kwargs)
        answers.append(answer)
        blocks = [block.model_dump(exclude_none=True) for block in answer.content]
        messages.append({"role": "assistant", "content": blocks})
        results = [
            {"type": "tool_result", "tool_use_id": b["id"], "content": f"r{i}"}
            for b in blocks
            if b["type"] == "tool_use"
        ]
        messages.append({"role": "user", "content": results or f"next {i}"})
    return answers


async def chat_episode(stack: Stack, session_id: str, turns: int) -> None:
    """The same loop in chat completions."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": USER}]
    for i in range(turns):
        response = await stack.chat(
            session_id,
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            max_tokens=MAX_TOKENS,
            seed=i,
        )
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        messages.append(echo(message))
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"r{i}"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": f"next {i}"})


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
async def test_a_messages_episode_is_the_chat_episode(
    make_stack: StackFactory, stream: bool
) -> None:
    trajectories = []
    for protocol in ("chat", "messages"):
        stack = await make_stack()
        session_id = await stack.create()
        if protocol == "chat":
            await chat_episode(stack, session_id, turns=4)
        else:
            answers = await messages_episode(client(stack, session_id), turns=4, stream=stream)
            assert any(block.type == "tool_use" for a in answers for block in a.content)
            for answer in answers:
                uses = [b for b in answer.content if b.type == "tool_use"]
                assert answer.stop_reason == ("tool_use" if uses else "end_turn")
                assert answer.usage.output_tokens > 0
        doc = await stack.trajectory(session_id)
        check_document(doc)
        trajectories.append(committed(doc))
    assert trajectories[0] == trajectories[1]
    assert trajectories[0][3] == 1  # one segment: every turn extended the last


async def test_thinking_streamed_and_not_give_one_trajectory(make_stack: StackFactory) -> None:
    trajectories = []
    for stream in (False, True):
        stack = await make_stack(template="qwen3", emulator=EmulatorConfig(reasoning=True))
        session_id = await stack.create()
        answers = await messages_episode(
            client(stack, session_id), turns=4, stream=stream, thinking=True
        )
        kinds = [block.type for block in answers[0].content]
        assert kinds[0] == "thinking", kinds
        first = answers[0].content[0]
        assert isinstance(first, anthropic.types.ThinkingBlock) and first.thinking
        doc = await stack.trajectory(session_id)
        check_document(doc)
        assert len(doc["turns"]) == 4
        trajectories.append(committed(doc))
    assert trajectories[0] == trajectories[1]
    assert trajectories[0][3] == 1  # the thinking blocks sent back matched what was stored


async def test_the_event_stream_is_anthropics(stack: Stack) -> None:
    session_id = await stack.create()
    body = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "messages": [{"role": "user", "content": USER}],
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "any"},
    }
    response = await stack.client.post(f"/sessions/{session_id}/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in response.text.split("\n\n"):
        if frame:
            name, data = frame.split("\n")
            event = orjson.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            events.append(event)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"]["output_tokens"] > 0
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert starts[-1]["content_block"]["type"] == "tool_use"
    index = starts[-1]["index"]
    partial = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == index
    )
    assert "path" in orjson.loads(partial)
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")


async def test_stop_sequences_and_max_tokens_give_their_stop_reason(stack: Stack) -> None:
    session_id = await stack.create()
    agent = client(stack, session_id)
    cut = await agent.messages.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": USER}]
    )
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


async def test_count_tokens_is_the_next_turns_prompt_length(stack: Stack) -> None:
    session_id = await stack.create()
    agent = client(stack, session_id)
    messages: list[Any] = [{"role": "user", "content": USER}]
    for i in range(2):
        counted = await agent.messages.count_tokens(
            model=MODEL, messages=messages, tools=ANTHROPIC_TOOLS, system="Be brief."
        )
        answer = await agent.messages.create(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=messages,
            tools=ANTHROPIC_TOOLS,
            system="Be brief.",
        )
        doc = await stack.trajectory(session_id)
        assert len(doc["turns"]) == i + 1  # counting committed nothing
        assert counted.input_tokens == doc["turns"][-1]["completion_start"]
        blocks = [b.model_dump(exclude_none=True) for b in answer.content]
        results = [
            {"type": "tool_result", "tool_use_id": b["id"], "content": "ok"}
            for b in blocks
            if b["type"] == "tool_use"
        ]
        messages += [
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": results or "more"},
        ]
    assert stack.emulator.received == 2


async def test_the_sdk_raises_its_typed_errors(make_stack: StackFactory) -> None:
    stack = await make_stack(emulator=EmulatorConfig(base_latency_s=0.5))
    session_id = await stack.create()
    agent = client(stack, session_id)
    image: Any = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "x"},
    }
    with pytest.raises(anthropic.BadRequestError) as bad:
        await agent.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [image]}]
        )
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages[0].content[0]: image content is not supported",
            "code": "invalid_request",
        },
    }
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client(stack, "nobody").messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": USER}]
        )
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["error"]["type"] == "not_found_error"
    errors: list[Exception] = []

    async def turn() -> None:
        try:
            await agent.messages.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": USER}]
            )
        except anthropic.APIStatusError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        nursery.start_soon(turn)
    assert len(errors) == 1 and isinstance(errors[0], anthropic.ConflictError)
    assert errors[0].body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": errors[0].body["error"]["message"],  # type: ignore[index]
            "code": "session_busy",
        },
    }
    assert len((await stack.trajectory(session_id))["turns"]) == 1


async def test_x_api_key_is_a_key(make_stack: StackFactory) -> None:
    stack = await make_stack(api_key="trainer")
    created = await stack.client.post("/sessions", json={})
    session_id, key = created.json()["session_id"], created.json()["api_key"]
    answer = await client(stack, session_id, api_key=key).messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": USER}]
    )
    assert answer.content
    # The session's key names its session at the root too.
    at_root = await client(stack, None, api_key=key).messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "again"}]
    )
    assert at_root.content
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await client(stack, session_id, api_key="wrong").messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": USER}]
        )
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["error"]["type"] == "authentication_error"
    # x-api-key works on every route, not only the Messages one.
    listed = await stack.client.get("/sessions", headers={"authorization": "", "x-api-key": key})
    assert listed.status_code == 401  # a session's key reaches only its model routes
    trainer = await stack.client.get(
        "/sessions", headers={"authorization": "", "x-api-key": "trainer"}
    )
    assert trainer.status_code == 200
    assert stack.emulator.received == 2


async def test_messages_at_the_root_with_the_session_header(stack: Stack) -> None:
    session_id = await stack.create()
    agent = client(stack, None, default_headers={"X-Session-ID": session_id})
    answer = await agent.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": USER}]
    )
    assert answer.content
    counted = await agent.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": USER}]
    )
    assert counted.input_tokens > 0
    assert len((await stack.trajectory(session_id))["turns"]) == 1
    with pytest.raises(anthropic.NotFoundError) as unnamed:
        await client(stack, None).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": USER}]
        )
    assert isinstance(unnamed.value.body, dict)
    assert "X-Session-ID" in unnamed.value.body["error"]["message"]


_USER = [{"role": "user", "content": USER}]
_OK: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "messages": _USER}
_IMAGE = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
_TOOL_USE = {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a"}}


def _with(**fields: Any) -> bytes:
    return orjson.dumps({**_OK, **fields})


def _without(name: str) -> bytes:
    return orjson.dumps({k: v for k, v in _OK.items() if k != name})


BAD_INPUTS: list[tuple[str, bytes]] = [
    ("not-json", b"{not json"),
    ("json-array", b"[1, 2]"),
    ("empty-body", b""),
    ("no-model", _without("model")),
    ("model-int", _with(model=3)),
    ("no-max-tokens", _without("max_tokens")),
    ("max-tokens-zero", _with(max_tokens=0)),
    ("max-tokens-string", _with(max_tokens="8")),
    ("max-tokens-bool", _with(max_tokens=True)),
    ("no-messages", _without("messages")),
    ("messages-empty", _with(messages=[])),
    ("messages-object", _with(messages={"role": "user"})),
    ("message-not-object", _with(messages=["hi"])),
    ("role-tool", _with(messages=[{"role": "tool", "content": "x"}])),
    ("system-message-image", _with(messages=[*_USER, {"role": "system", "content": [_IMAGE]}])),
    ("content-int", _with(messages=[{"role": "user", "content": 5}])),
    ("block-not-object", _with(messages=[{"role": "user", "content": ["x"]}])),
    ("block-no-type", _with(messages=[{"role": "user", "content": [{"text": "x"}]}])),
    ("block-unknown", _with(messages=[{"role": "user", "content": [{"type": "video"}]}])),
    ("text-not-string", _with(messages=[{"role": "user", "content": [{"type": "text"}]}])),
    ("image", _with(messages=[{"role": "user", "content": [_IMAGE]}])),
    (
        "document",
        _with(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
    ),
    ("tool-use-from-user", _with(messages=[{"role": "user", "content": [_TOOL_USE]}])),
    (
        "tool-result-from-assistant",
        _with(
            messages=[
                *_USER,
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            ]
        ),
    ),
    (
        "tool-result-no-id",
        _with(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]),
    ),
    (
        "tool-result-image",
        _with(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": [_IMAGE]}],
                }
            ]
        ),
    ),
    (
        "tool-result-is-error-string",
        _with(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}],
                }
            ]
        ),
    ),
    (
        "tool-use-input-string",
        _with(messages=[*_USER, {"role": "assistant", "content": [{**_TOOL_USE, "input": "{}"}]}]),
    ),
    (
        "thinking-not-string",
        _with(messages=[*_USER, {"role": "assistant", "content": [{"type": "thinking"}]}]),
    ),
    ("system-int", _with(system=1)),
    ("system-image", _with(system=[_IMAGE])),
    ("tools-object", _with(tools={"name": "x"})),
    ("server-tool", _with(tools=[{"type": "web_search_20250305", "name": "web_search"}])),
    ("tool-no-schema", _with(tools=[{"name": "x"}])),
    ("tool-no-name", _with(tools=[{"input_schema": {}}])),
    ("tool-description-int", _with(tools=[{"name": "x", "input_schema": {}, "description": 1}])),
    ("tool-choice-string", _with(tool_choice="auto")),
    ("tool-choice-unknown", _with(tool_choice={"type": "all"})),
    ("tool-choice-tool-no-name", _with(tool_choice={"type": "tool"})),
    ("stop-sequences-string", _with(stop_sequences="\n")),
    ("stop-sequences-empty-string", _with(stop_sequences=[""])),
    ("thinking-string", _with(thinking="on")),
    ("thinking-unknown", _with(thinking={"type": "maybe"})),
    ("stream-string", _with(stream="yes")),
    ("mcp-servers", _with(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}])),
    ("template-kwargs-list", _with(thinking={"type": "enabled"}, chat_template_kwargs=[1])),
    ("temperature-string", _with(temperature="hot")),
    # The rest of the chat route's rows (test_api.BAD_CHAT), as Anthropic spells them.
    ("role-unknown", _with(messages=[{"role": "wizard", "content": "x"}])),
    ("temperature-nan", _with().replace(b"}", b', "temperature": NaN}')),
    ("temperature-high", _with(temperature=9.5)),
    ("top-p-high", _with(top_p=1.5)),
    ("top-k-string", _with(top_k="5")),
    ("n-2", _with(n=2)),
    ("stop-sequences-ints", _with(stop_sequences=[3])),
    ("tool-not-object", _with(tools=["read_file"])),
    ("tool-choice-int", _with(tool_choice=1)),
    ("metadata-string", _with(metadata="x")),
]


# The root route is the session route once the edge has read the session
# header (session_routing.py), and count_tokens parses with the same
# `parse_messages_request` (which takes no max_tokens there, and no sampling
# fields matter): a few rows of each kind show the same answer.
ROOT_ROWS = ("not-json", "json-array", "no-max-tokens", "block-unknown", "server-tool")
COUNT_ROWS = ("not-json", "no-messages", "block-unknown", "server-tool", "tool-no-schema")
BAD_COUNTS = [(n, b) for n, b in BAD_INPUTS if n in COUNT_ROWS]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        *(("messages", body) for _, body in BAD_INPUTS),
        *(("root", body) for n, body in BAD_INPUTS if n in ROOT_ROWS),
        *(("count", body) for _, body in BAD_COUNTS),
    ],
    ids=[
        *(f"messages-{n}" for n, _ in BAD_INPUTS),
        *(f"root-{n}" for n, _ in BAD_INPUTS if n in ROOT_ROWS),
        *(f"count-{n}" for n, _ in BAD_COUNTS),
    ],
)
async def test_bad_input_is_a_4xx_in_anthropics_shape(
    stack: Stack, route: str, body: bytes
) -> None:
    session_id = await stack.create()
    first = await stack.client.post(f"/sessions/{session_id}/v1/messages", content=_with())
    assert first.status_code == 200, first.text
    before = (await stack.client.get(f"/sessions/{session_id}/trajectory")).content
    received = stack.emulator.received
    path = {
        "messages": f"/sessions/{session_id}/v1/messages",
        "root": "/v1/messages",
        "count": f"/sessions/{session_id}/v1/messages/count_tokens",
    }[route]
    response = await stack.client.post(
        path,
        content=body,
        headers={"content-type": "application/json", "X-Session-ID": session_id},
    )
    assert 400 <= response.status_code < 500, response.text
    doc = response.json()
    assert doc["type"] == "error"
    assert doc["error"]["type"] == "invalid_request_error"
    assert doc["error"]["message"]
    assert stack.emulator.received == received
    assert (await stack.client.get(f"/sessions/{session_id}/trajectory")).content == before


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [
        ("GET", "/sessions/{id}/v1/messages", 405, "invalid_request_error"),
        ("POST", "/sessions/nobody/v1/messages", 404, "not_found_error"),
        ("POST", "/sessions/nobody/v1/messages/count_tokens", 404, "not_found_error"),
        ("POST", "/v1/messages", 404, "not_found_error"),
    ],
    ids=["wrong-method", "unknown-session", "count-unknown-session", "root-no-session"],
)
async def test_the_edges_refusals_are_in_anthropics_shape(
    stack: Stack, method: str, path: str, status: int, kind: str
) -> None:
    session_id = await stack.create()
    response = await stack.client.request(method, path.format(id=session_id), content=_with())
    assert response.status_code == status, response.text
    assert response.json()["error"]["type"] == kind


async def test_too_large_and_unauthorized_are_in_anthropics_shape(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(api_key="k", max_body_mb=0.01)
    created = await stack.client.post("/sessions", json={})
    session_id = created.json()["session_id"]
    path = f"/sessions/{session_id}/v1/messages"
    big = await stack.client.post(path, content=_with(system="x" * 20_000))
    assert big.status_code == 413
    assert big.json()["error"]["type"] == "request_too_large"
    anonymous = await stack.client.post(path, content=_with(), headers={"authorization": ""})
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("fault", "kind"),
    [("http_400", "invalid_request_error"), ("http_500", "api_error")],
    ids=["worker-400", "worker-500"],
)
async def test_a_workers_error_is_in_anthropics_shape(stack: Stack, fault: str, kind: str) -> None:
    session_id = await stack.create()
    stack.emulator.faults = FaultPicker(fault, 1.0, 0)
    response = await stack.client.post(f"/sessions/{session_id}/v1/messages", content=_with())
    assert response.status_code == int(fault[-3:]) or response.status_code >= 500, response.text
    doc = response.json()
    assert doc["type"] == "error" and doc["error"]["message"]
    assert doc["error"]["type"] == kind
    assert (await stack.trajectory(session_id))["turns"] == []
