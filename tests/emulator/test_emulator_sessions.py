"""The emulator's SGLang 0.5.23 sessions over real sockets: /open_session,
/close_session, streaming appends on /generate, timeouts, refusals, held KV
(docs/emulator.md, "Sessions")."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from rollout_session.emulator.app import start_emulator
from rollout_session.emulator.model.generation import TextModel
from rollout_session.emulator.worker import Emulator, EmulatorConfig
from tests.emulator.conftest import Serve
from tests.families import family_path, family_text_model
from tests.loopback import TLS

NOT_EXIST = "Invalid request: session id {} does not exist"
DUPLICATE = "Failed to open the session. Check if a session with the same id is still open."


@pytest.fixture(scope="module")
def llama() -> TextModel:
    return family_text_model("llama-3.1")


@pytest.fixture
async def serve(nursery: trio.Nursery, model: TextModel) -> AsyncIterator[Serve]:
    """Start emulators with streaming sessions on (config overrides as keywords)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            own_model: TextModel | None = None, **overrides: Any
        ) -> tuple[httpx.AsyncClient, Emulator]:
            overrides.setdefault("enable_streaming_session", True)
            config = EmulatorConfig(**overrides)
            server, emulator = await start_emulator(nursery, config, model=own_model or model)
            stack.push_async_callback(server.aclose)
            client = httpx.AsyncClient(base_url=server.url, timeout=10.0, verify=TLS)
            await stack.enter_async_context(client)
            return client, emulator

        yield start


async def open_session(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post(
        "/open_session", json={"capacity_of_str_len": 1000, "streaming": True, **body}
    )


async def generate(
    client: httpx.AsyncClient, ids: list[int], sid: str | None = None, **extra: Any
) -> httpx.Response:
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 32, "temperature": 1.0},
        **extra,
    }
    if sid is not None:
        body["session_params"] = {"id": sid, **body.get("session_params", {})}
    return await client.post("/generate", json=body)


async def turn(client: httpx.AsyncClient, ids: list[int], sid: str | None = None) -> Any:
    response = await generate(client, ids, sid)
    assert response.status_code == 200, response.text
    return response.json()


def error(response: httpx.Response) -> str:
    """SGLang's native-route error ({"error": {"message"}}), status 400."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message"}
    message: str = body["error"]["message"]
    return message


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


async def test_open_append_close(serve: Serve) -> None:
    client, emulator = await serve()
    opened = await open_session(client, session_id="a")
    assert opened.status_code == 200 and opened.json() == "a"
    assert emulator.open_sessions == {"a"}

    first = await turn(client, ids(1000, 100), "a")
    out1 = first["output_ids"]
    assert first["meta_info"]["prompt_tokens"] == 100
    assert first["meta_info"]["cached_tokens"] == 0
    second = await turn(client, ids(2000, 20), "a")
    # prompt_tokens is the full context; the slot serves all of it but the
    # last sampled token (never forwarded, so no KV).
    assert second["meta_info"]["prompt_tokens"] == 100 + len(out1) + 20
    assert second["meta_info"]["cached_tokens"] == 100 + len(out1) - 1
    assert emulator.sessions.held_tokens == 100 + len(out1) + 20 + len(second["output_ids"]) - 1

    closed = await client.post("/close_session", json={"session_id": "a"})
    assert closed.status_code == 200 and closed.content == b""
    assert emulator.open_sessions == set() and emulator.sessions.held_tokens == 0
    assert error(await generate(client, ids(3000, 5), "a")) == NOT_EXIST.format("a")
    # An unknown id is no error: SGLang logs and answers 200.
    assert (await client.post("/close_session", json={"session_id": "a"})).status_code == 200


async def test_open_without_id_gets_a_fresh_one(serve: Serve) -> None:
    client, emulator = await serve()
    response = await open_session(client)
    sid = response.json()
    assert response.status_code == 200 and isinstance(sid, str) and len(sid) == 32
    assert emulator.open_sessions == {sid}


async def test_context_after_appends_is_the_full_prompt(serve: Serve) -> None:
    client, emulator = await serve()
    await open_session(client, session_id="a")
    full: list[int] = []
    answers = []
    for k in range(4):
        new = ids(1000 + 100 * k, 10 + k)
        answer = await turn(client, new, "a")
        full += new
        assert answer["meta_info"]["prompt_tokens"] == len(full)
        answers.append(answer)
        full += answer["output_ids"]
    assert emulator.sessions.context("a") == full
    # The same context sent whole, without a session, on a fresh worker:
    # same prompt length, same sampled tokens (sampling is seeded by the prompt).
    other, _ = await serve()
    last_prompt = full[: -len(answers[-1]["output_ids"])]
    plain = await turn(other, last_prompt)
    assert plain["meta_info"]["prompt_tokens"] == answers[-1]["meta_info"]["prompt_tokens"]
    assert plain["output_ids"] == answers[-1]["output_ids"]


@pytest.mark.parametrize("leading", ["bos", "other"], ids=["bos_stripped", "no_bos_kept"])
async def test_bos_strip_on_appended_turn(serve: Serve, llama: TextModel, leading: str) -> None:
    client, emulator = await serve(llama, tokenizer_path=family_path("llama-3.1"))
    bos = llama.tokenizer.bos_token_id
    assert isinstance(bos, int)
    await open_session(client, session_id="a")
    first = await turn(client, [bos, *ids(1000, 10)], "a")
    # The first turn keeps its BOS: there is no history yet.
    assert first["meta_info"]["prompt_tokens"] == 11
    head = bos if leading == "bos" else 5
    second = await turn(client, [head, *ids(2000, 5)], "a")
    kept = 5 if leading == "bos" else 6
    assert second["meta_info"]["prompt_tokens"] == 11 + len(first["output_ids"]) + kept
    context = emulator.sessions.context("a")
    assert context is not None and context.count(bos) == 1


async def test_bundled_tokenizer_has_no_bos_so_nothing_is_stripped(serve: Serve) -> None:
    client, emulator = await serve()
    assert emulator.sessions.bos_token_id is None
    await open_session(client, session_id="a")
    first = await turn(client, ids(1000, 10), "a")
    second = await turn(client, ids(0, 5), "a")
    assert second["meta_info"]["prompt_tokens"] == 10 + len(first["output_ids"]) + 5


async def test_duplicate_open_is_refused(serve: Serve) -> None:
    client, _ = await serve()
    assert (await open_session(client, session_id="a")).status_code == 200
    assert error(await open_session(client, session_id="a")) == DUPLICATE
    assert error(await open_session(client, session_id="a", streaming=False)) == DUPLICATE


async def test_unknown_session_fails_like_sglang(serve: Serve) -> None:
    client, emulator = await serve()
    assert error(await generate(client, ids(1000, 5), "nope")) == NOT_EXIST.format("nope")
    # Empty input_ids are only allowed with a session (history may be the prompt).
    assert error(await generate(client, [])) == "input_ids cannot be empty."
    assert error(await generate(client, [], "nope")) == NOT_EXIST.format("nope")
    both = await generate(client, ids(1, 3), "x", session_id="x")
    assert error(both) == "session_id and session_params cannot both be set."
    assert emulator.sessions.opened == 0


async def test_restart_loses_every_session(serve: Serve) -> None:
    client, _ = await serve()
    await open_session(client, session_id="a")
    await turn(client, ids(1000, 10), "a")
    restarted, emulator = await serve()  # a new worker process has an empty controller
    assert emulator.open_sessions == set()
    assert error(await generate(restarted, ids(1, 3), "a")) == NOT_EXIST.format("a")


async def test_timeout_reaps_on_the_emulator_clock(serve: Serve) -> None:
    client, emulator = await serve()
    await open_session(client, session_id="a", timeout=5)
    await open_session(client, session_id="b")  # no timeout: never reaped
    await turn(client, ids(1000, 10), "a")
    emulator.advance_clock(4)
    await turn(client, ids(2000, 3), "a")  # activity restarts the timeout
    emulator.advance_clock(4)
    assert emulator.open_sessions == {"a", "b"}
    emulator.advance_clock(2)
    assert emulator.open_sessions == {"b"}
    assert emulator.sessions.timed_out == 1 and emulator.sessions.held_tokens == 0
    assert error(await generate(client, ids(3000, 3), "a")) == NOT_EXIST.format("a")
    stats = (await client.get("/emulator/stats")).json()["kv_sessions"]
    assert stats["open"] == 1 and stats["timed_out"] == 1


async def _in_flight(
    client: httpx.AsyncClient, emulator: Emulator, nursery: trio.Nursery, sid: str
) -> tuple[trio.CancelScope, list[httpx.Response]]:
    """Start a turn on ``sid`` that runs until cancelled; return once it is in flight."""
    emulator.config = dataclasses.replace(emulator.config, base_latency_s=3600.0)
    scope = trio.CancelScope()
    got: list[httpx.Response] = []

    async def run() -> None:
        with scope:
            got.append(await generate(client, ids(5000, 4), sid))

    nursery.start_soon(run)
    await emulator.wait_until(lambda: emulator.sessions.stats()["sessions"][sid]["inflight"])
    emulator.config = dataclasses.replace(emulator.config, base_latency_s=0.0)
    return scope, got


async def test_second_request_while_in_flight_is_refused(
    serve: Serve, nursery: trio.Nursery
) -> None:
    client, emulator = await serve()
    await open_session(client, session_id="a")
    first = await turn(client, ids(1000, 10), "a")
    scope, _ = await _in_flight(client, emulator, nursery, "a")
    assert error(await generate(client, ids(2000, 3), "a")) == (
        "Streaming session already has an active request."
    )
    # The client goes away: SGLang aborts the turn; the session keeps its last
    # finished turn and drops its slot (the next turn re-prefills).
    scope.cancel()
    await emulator.wait_for_cancelled(1)
    assert emulator.sessions.held_tokens == 0
    after = await turn(client, ids(2000, 3), "a")
    assert after["meta_info"]["prompt_tokens"] == 10 + len(first["output_ids"]) + 3
    # Only the first prompt was published into the prefix cache.
    assert after["meta_info"]["cached_tokens"] == 0


async def test_close_while_in_flight_is_deferred_until_the_turn_ends(
    serve: Serve, nursery: trio.Nursery
) -> None:
    client, emulator = await serve()
    await open_session(client, session_id="a")
    await turn(client, ids(1000, 10), "a")
    scope, got = await _in_flight(client, emulator, nursery, "a")
    assert (await client.post("/close_session", json={"session_id": "a"})).status_code == 200
    assert emulator.open_sessions == {"a"}  # still decoding on the session's KV
    assert error(await generate(client, ids(2000, 3), "a")) == (
        "Invalid request: close was requested for session a"
    )
    assert error(await open_session(client, session_id="a")) == DUPLICATE
    scope.cancel()  # the turn aborts: the deferred close goes through
    await emulator.wait_until(lambda: "a" not in emulator.sessions)
    assert got == [] and emulator.sessions.closed == 1
    assert (await open_session(client, session_id="a")).status_code == 200


async def test_close_while_in_flight_completes_when_the_turn_finishes(serve: Serve) -> None:
    client, emulator = await serve(base_latency_s=0.3)
    await open_session(client, session_id="a")
    async with trio.open_nursery() as nursery:
        results: list[httpx.Response] = []

        async def run() -> None:
            results.append(await generate(client, ids(1000, 10), "a"))

        nursery.start_soon(run)
        await emulator.wait_until(lambda: emulator.sessions.stats()["sessions"]["a"]["inflight"])
        closed = await client.post("/close_session", json={"session_id": "a"})
        assert closed.status_code == 200
    [answer] = results
    assert answer.status_code == 200 and answer.json()["meta_info"]["prompt_tokens"] == 10
    assert "a" not in emulator.sessions and emulator.sessions.closed == 1


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"replace": True}, "Streaming sessions do not support replace."),
        ({"offset": 3}, "Streaming sessions do not support offset."),
        (
            {"drop_previous_output": True},
            "Streaming sessions do not support drop_previous_output.",
        ),
    ],
    ids=["replace", "offset", "drop_previous_output"],
)
async def test_history_rewrites_are_refused_on_streaming(
    serve: Serve, params: dict[str, Any], message: str
) -> None:
    client, emulator = await serve()
    await open_session(client, session_id="a")
    first = await turn(client, ids(1000, 10), "a")
    response = await generate(client, ids(2000, 3), "a", session_params=params)
    assert error(response) == message
    # The refusal leaves the session as it was.
    assert emulator.sessions.context("a") == [*ids(1000, 10), *first["output_ids"]]
    assert (await turn(client, ids(2000, 3), "a"))["meta_info"]["prompt_tokens"] == (
        10 + len(first["output_ids"]) + 3
    )


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"session_id": "a", "streaming": True}, 400, "capacity_of_str_len"),
        ({"capacity_of_str_len": 1, "session_id": "a", "streaming": True}, 200, None),
    ],
    ids=["capacity_required", "capacity_not_enforced"],
)
async def test_capacity_of_str_len(
    serve: Serve, body: dict[str, Any], status: int, message: str | None
) -> None:
    client, _ = await serve()
    response = await client.post("/open_session", json=body)
    assert response.status_code == status
    if message is not None:
        flat = response.json()
        assert flat["object"] == "error" and flat["code"] == 400 and message in flat["message"]
        return
    # SGLang stores capacity_of_str_len and never checks it.
    await turn(client, ids(1000, 200), "a")
    assert (await turn(client, ids(2000, 200), "a"))["meta_info"]["prompt_tokens"] > 400


async def test_streaming_needs_the_server_flag(serve: Serve) -> None:
    client, _ = await serve(enable_streaming_session=False)
    assert error(await open_session(client, session_id="a")) == (
        "Streaming sessions are disabled. Please relaunch with --enable-streaming-session."
    )
    assert (await open_session(client, session_id="a", streaming=False)).status_code == 200


async def test_held_kv_is_not_evicted_by_other_traffic(serve: Serve) -> None:
    client, emulator = await serve(cache_capacity_tokens=1024)
    await open_session(client, session_id="agent")
    first = await turn(client, ids(1000, 300), "agent")
    held = emulator.sessions.held_tokens
    assert held == 300 + len(first["output_ids"]) - 1
    assert emulator.cache.reserved_tokens == held
    # Another agent without a session, then traffic that fills the cache.
    plain = await turn(client, ids(20000, 300))
    for k in range(6):
        await turn(client, ids(40000 + 1000 * k, 300))
    assert emulator.cache.used_tokens + held <= 1024
    again = await turn(client, [*ids(20000, 300), *plain["output_ids"], *ids(30000, 5)])
    assert again["meta_info"]["cached_tokens"] == 0  # evicted
    second = await turn(client, ids(2000, 5), "agent")
    assert second["meta_info"]["cached_tokens"] == held  # held in the session's slot


async def test_chat_route_ignores_session_params(serve: Serve) -> None:
    """SGLang's chat route declares session_params but never passes it on:
    the worker's prompt is the request's input_ids alone."""
    client, emulator = await serve()
    await open_session(client, session_id="a")
    await turn(client, ids(1000, 50), "a")
    response = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "input_ids": ids(2000, 7),
            "session_params": {"id": "a"},
            "return_meta_info": True,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 7
    assert emulator.sessions.context("a") is not None
    assert len(emulator.sessions.context("a") or []) > 50  # untouched by the chat call


@pytest.mark.parametrize("route", ["chat", "generate"], ids=["chat", "generate"])
async def test_priority_is_accepted_and_range_checked(serve: Serve, route: str) -> None:
    client, _ = await serve()

    async def send(priority: Any) -> httpx.Response:
        if route == "generate":
            return await generate(client, ids(1000, 5), priority=priority)
        return await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "input_ids": ids(1000, 5),
                "priority": priority,
            },
        )

    assert (await send(7)).status_code == 200
    bad = await send(1 << 63)
    assert bad.status_code == 400
    assert "priority must be a signed 64-bit integer" in bad.text
    wrong_type = await send("high")  # FastAPI's validation error: flat, "Bad Request"
    assert wrong_type.status_code == 400 and wrong_type.json()["type"] == "Bad Request"


async def test_counters_for_bytes_and_prefill(serve: Serve) -> None:
    client, emulator = await serve()
    await open_session(client, session_id="a")
    first = await turn(client, ids(1000, 500), "a")
    second = await turn(client, ids(2000, 4), "a")
    big, small = emulator.requests[-2], emulator.requests[-1]
    assert big.route == small.route == "generate" and big.session_id == "a"
    assert small.body_bytes < big.body_bytes / 10
    assert emulator.bytes_received == big.body_bytes + small.body_bytes
    prompt2 = second["meta_info"]["prompt_tokens"]
    assert emulator.prompt_tokens == 500 + prompt2
    assert emulator.cached_tokens == 500 + len(first["output_ids"]) - 1
    assert emulator.prefill_tokens == emulator.prompt_tokens - emulator.cached_tokens
    stats = (await client.get("/emulator/stats")).json()
    assert stats["prefill_tokens"] == emulator.prefill_tokens
    assert stats["bytes_received"] == emulator.bytes_received
    assert stats["kv_sessions"]["sessions"]["a"]["held_tokens"] == emulator.sessions.held_tokens


async def test_non_streaming_session_appends_to_a_named_request(serve: Serve) -> None:
    client, emulator = await serve()
    await open_session(client, session_id="n", streaming=False)
    first = await generate(client, ids(1000, 40), "n", rid="r1")
    out1 = first.json()["output_ids"]
    # Without a rid the request starts from its own ids (no history).
    alone = await turn(client, ids(3000, 5), "n")
    assert alone["meta_info"]["prompt_tokens"] == 5
    child = await generate(client, ids(2000, 6), "n", session_params={"rid": "r1"})
    assert child.json()["meta_info"]["prompt_tokens"] == 40 + len(out1) + 6
    # Its KV goes through the ordinary prefix cache (16-token blocks).
    assert child.json()["meta_info"]["cached_tokens"] == (40 + len(out1)) // 16 * 16
    assert emulator.sessions.held_tokens == 0
    missing = await generate(client, ids(1, 2), "n", session_params={"rid": "zz"})
    assert error(missing) == "Invalid request session id"
