"""The agent side through the official `openai` SDK, unmodified.

Sync `OpenAI` runs in a thread (`trio.to_thread.run_sync`), `AsyncOpenAI`
directly under trio. Every client has ``max_retries=0``: the SDK would
otherwise retry 409/5xx answers behind the test's back.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import openai
import pytest
import trio
from openai.types.chat import ChatCompletionChunk

from rollout_session.emulator.worker import EmulatorConfig
from tests.conftest import TOOLS, Stack, StackFactory
from tests.integration.session.test_turns import check_document
from tests.loopback import TLS

USER: list[Any] = [{"role": "user", "content": "What is in main.py?"}]
MODEL = EmulatorConfig().model_name


def base_url(stack: Stack, session_id: str) -> str:
    return f"{stack.url}/sessions/{session_id}/v1"


def sync_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url,
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=TLS),
    )


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url,
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
    )


def collect(chunks: Iterable[ChatCompletionChunk]) -> tuple[dict[str, Any], str | None]:
    """The message and finish reason an agent rebuilds from streamed deltas."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: list[dict[str, Any]] = []
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append({"id": call.id, "type": "function", "function": {}})
                function = calls[call.index]["function"]
                for key, value in (
                    call.function.model_dump(exclude_none=True) if call.function else {}
                ).items():
                    function[key] = function.get(key, "") + value
            finish = choice.finish_reason or finish
    if calls:
        message["tool_calls"] = calls
    return message, finish


def plain(message: Any) -> dict[str, Any]:
    """An SDK message as an agent appends it to its history."""
    data: dict[str, Any] = message.model_dump(exclude_none=True)
    out: dict[str, Any] = {k: data[k] for k in ("role", "content") if k in data}
    if data.get("tool_calls"):
        # OpenAI's fields only (SGLang adds its own, e.g. index).
        out["tool_calls"] = [
            {k: c[k] for k in ("id", "type", "function")} for c in data["tool_calls"]
        ]
    return out


def sync_episode(url: str, *, stream: bool) -> list[Any]:
    """A plain synchronous tool-calling agent, as users write them."""
    client = sync_client(url)
    model = client.models.list().data[0].id
    messages: list[Any] = list(USER)
    finishes = []
    for seed in (3, 4):
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "tools": TOOLS,
            "seed": seed,
        }
        if stream:
            chunks = client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
            with chunks:
                message, finish = collect(chunks)
        else:
            answer = client.chat.completions.create(**kwargs)
            message, finish = plain(answer.choices[0].message), answer.choices[0].finish_reason
        messages.append(message)
        finishes.append(finish)
        for call in message.get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "print('hi')"})
    client.close()
    assert finishes == ["tool_calls", "stop"]
    return messages


async def async_episode(url: str, *, stream: bool) -> list[Any]:
    """The same agent on `AsyncOpenAI`; streaming through the SDK's own accumulator."""
    client = async_client(url)
    try:
        model = (await client.models.list()).data[0].id
        messages: list[Any] = list(USER)
        for seed in (3, 4):
            kwargs: dict[str, Any] = {
                "model": model,
                "messages": messages,
                "tools": TOOLS,
                "seed": seed,
            }
            if stream:
                async with client.chat.completions.stream(**kwargs) as events:
                    answer: Any = await events.get_final_completion()
            else:
                answer = await client.chat.completions.create(**kwargs)
            message = plain(answer.choices[0].message)
            messages.append(message)
            for call in message.get("tool_calls", []):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "x"})
    finally:
        await client.close()
    return messages


async def run_episode(kind: str, url: str, *, stream: bool) -> list[Any]:
    if kind == "sync":
        return await trio.to_thread.run_sync(functools.partial(sync_episode, url, stream=stream))
    return await async_episode(url, stream=stream)


# The SDK stops reading at `data: [DONE]` and leaves its inner async
# generators suspended; trio's finalizer warns when they are collected (asyncio
# closes them silently). Nothing leaks: the response is closed by the SDK.
SDK_ASYNC_STREAM_GC = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\.:ResourceWarning"
)


@pytest.mark.parametrize(
    "kind",
    ["sync", pytest.param("async", marks=SDK_ASYNC_STREAM_GC)],
    ids=["OpenAI", "AsyncOpenAI"],
)
async def test_streamed_conversation_equals_plain_one(stack: Stack, kind: str) -> None:
    plain_id, streamed_id = await stack.create(), await stack.create()
    plain_messages = await run_episode(kind, base_url(stack, plain_id), stream=False)
    streamed_messages = await run_episode(kind, base_url(stack, streamed_id), stream=True)
    # user, tool call, tool result, final answer: same text and calls either way.
    assert [m["role"] for m in plain_messages] == ["user", "assistant", "tool", "assistant"]
    assert plain_messages[1]["tool_calls"] and plain_messages[3]["content"]
    assert streamed_messages == plain_messages
    docs = [await stack.trajectory(s) for s in (plain_id, streamed_id)]
    for doc in docs:
        check_document(doc)
        assert len(doc["turns"]) == 2
    keys = ("token_ids", "loss_mask", "logprobs", "messages")
    assert [docs[0][k] for k in keys] == [docs[1][k] for k in keys]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_request_parameters_reach_the_worker(stack: Stack, stream: bool) -> None:
    session_id = await stack.create()
    sent: dict[str, Any] = {
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "response_format": {"type": "text"},
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "stop": ["\n\n\n"],
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "logprobs": True,
        "top_logprobs": 2,
        "user": "agent-1",
        "metadata": {"run": "a"},
        "n": 1,
    }
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "top_k": 20, "min_p": 0.05}
    if stream:
        sent["stream_options"] = {"include_usage": True}

    def call() -> None:
        client = sync_client(base_url(stack, session_id))
        with client:
            answer = client.chat.completions.create(
                model=MODEL, messages=USER, stream=stream, extra_body=extra, **sent
            )
            if stream:
                assert collect(answer)[1] == "tool_calls"  # type: ignore[arg-type]

    await trio.to_thread.run_sync(call)
    body = stack.emulator.requests[-1].body
    sent.pop("stream_options", None)
    assert {k: body[k] for k in [*sent, *extra]} == {**sent, **extra}
    assert body["model"] == MODEL
    # Forced by the server whatever the agent sent.
    assert body["stream"] is False and "stream_options" not in body
    assert body["return_meta_info"] is True and body["no_stop_trim"] is False
    assert isinstance(body["input_ids"], list) and isinstance(body["rid"], str)


@pytest.mark.parametrize("kind", ["sync", "async"], ids=["OpenAI", "AsyncOpenAI"])
async def test_models_list_is_the_workers_model_and_cached(stack: Stack, kind: str) -> None:
    session_id = await stack.create()
    url = base_url(stack, session_id)

    async def model_ids() -> list[str]:
        models: Any
        if kind == "sync":
            client = sync_client(url)
            with client:
                models = await trio.to_thread.run_sync(client.models.list)
        else:
            async with async_client(url) as aclient:
                models = await aclient.models.list()
        return [m.id for m in models.data]

    assert await model_ids() == [MODEL]
    info = stack.ctx.model.info
    assert info is not None
    stack.workers[0].kill()  # the worker is gone; the card is kept
    assert await model_ids() == [MODEL]
    assert stack.ctx.model.info is info


# -- errors ------------------------------------------------------------------

# (id, emulator config, settings, request fields, exception, status, code, message part)
ERRORS: list[tuple[str, EmulatorConfig, dict[str, Any], dict[str, Any], type, int, Any, str]] = [
    (
        "400-n",
        EmulatorConfig(),
        {},
        {"n": 2},
        openai.BadRequestError,
        400,
        "invalid_request",
        "only n=1 is supported",
    ),
    (
        "400-worker",
        EmulatorConfig(context_length=64),
        {"context_length": 4096},
        {"max_tokens": 1000},
        openai.BadRequestError,
        400,
        "400",  # SGLang's own flat error, passed through (its code is an int)
        "maximum context length",
    ),
    (
        "502",
        EmulatorConfig(fault="nan_logprob"),
        {},
        {},
        openai.InternalServerError,
        502,
        "upstream_malformed",
        "worker answer",
    ),
    (
        "504",
        EmulatorConfig(fault="stall"),
        {"upstream_timeout_s": 0.3},
        {},
        openai.InternalServerError,
        504,
        "upstream_timeout",
        "did not answer within",
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("emulator", "settings", "fields", "exc_type", "status", "code", "text"),
    [e[1:] for e in ERRORS],
    ids=[e[0] for e in ERRORS],
)
async def test_sdk_raises_typed_errors_with_our_message(
    make_stack: StackFactory,
    emulator: EmulatorConfig,
    settings: dict[str, Any],
    fields: dict[str, Any],
    exc_type: type[openai.APIStatusError],
    status: int,
    code: str,
    text: str,
    stream: bool,
) -> None:
    stack = await make_stack(emulator=emulator, **settings)
    session_id = await stack.create()

    def call() -> openai.APIStatusError:
        client = sync_client(base_url(stack, session_id))
        with client, pytest.raises(exc_type) as info:
            client.chat.completions.create(model=MODEL, messages=USER, stream=stream, **fields)
        return info.value

    error = await trio.to_thread.run_sync(call)
    assert (error.status_code, error.code) == (status, code)
    assert text in error.message
    assert stack.ctx.registry.get(session_id).slot is None


async def test_unknown_session_is_not_found(stack: Stack) -> None:
    async with async_client(f"{stack.url}/sessions/nope/v1") as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model=MODEL, messages=USER)
        assert info.value.code == "session_not_found"
        assert "session nope does not exist" in info.value.message
        with pytest.raises(openai.NotFoundError):
            await client.models.list()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_busy_session_is_conflict(make_stack: StackFactory, stream: bool) -> None:
    stack = await make_stack(emulator=EmulatorConfig(base_latency_s=30.0))
    session_id = await stack.create()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(stack.chat, session_id, messages=USER))
        await stack.emulator.wait_for_requests(1)
        async with async_client(base_url(stack, session_id)) as client:
            with pytest.raises(openai.ConflictError) as info:
                await client.chat.completions.create(model=MODEL, messages=USER, stream=stream)
        nursery.cancel_scope.cancel()  # the first agent gives up
    assert info.value.code == "session_busy" and "in flight" in info.value.message
    assert info.value.response.headers["retry-after"]
    assert stack.emulator.received == 1  # the contender never reached the worker
    await stack.emulator.wait_for_cancelled(1)


async def test_no_worker_is_service_unavailable(stack: Stack) -> None:
    removed = await stack.client.delete("/workers", params={"url": stack.emulator_url})
    assert removed.status_code == 200, removed.text
    session_id = await stack.create()
    async with async_client(base_url(stack, session_id)) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=USER)
    assert (info.value.status_code, info.value.code) == (503, "no_healthy_worker")
    assert info.value.response.headers["retry-after"]


async def test_disconnect_mid_stream_then_next_turn_is_not_busy(make_stack: StackFactory) -> None:
    # A long answer (~120 kB of SSE): the agent hangs up long before its end.
    stack = await make_stack(emulator=EmulatorConfig(completion_tokens=20000))
    session_id = await stack.create()
    client = sync_client(base_url(stack, session_id))

    def hang_up() -> None:
        stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True)
        assert next(iter(stream)).choices[0].delta.role == "assistant"
        stream.close()

    def next_turn(history: list[Any]) -> None:
        answer = client.chat.completions.create(model=MODEL, messages=history)
        assert answer.choices[0].message.content

    with client:
        await trio.to_thread.run_sync(hang_up)
        # The turn was committed before its first byte was sent.
        answered = (await stack.trajectory(session_id))["messages"][-1]
        history = [*USER, {"role": "assistant", "content": answered["content"]}]
        history.append({"role": "user", "content": "go on"})
        await trio.to_thread.run_sync(next_turn, history)
    doc = await stack.trajectory(session_id)
    check_document(doc)
    assert len(doc["turns"]) == 2
