"""Expiry, caps, auth, pause/resume, metrics."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import openai
import pytest
import trio
import trio.testing

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig
from rollout_session.http.app import server_context
from rollout_session.http.routes.admin import MAX_WEIGHT_VERSION_CHARS
from rollout_session.session.expiry import Expiry
from rollout_session.session.session import Session, SessionRegistry, SessionState
from rollout_session.session.store import SessionStore
from tests.conftest import Stack, StackFactory
from tests.loopback import TLS

USER: list[Any] = [{"role": "user", "content": "hi"}]


def state_of(session: Session) -> SessionState:
    return session.state


class Unpinned:
    """The store's engine for sessions no worker ever held (no app is started)."""

    def adopt(self, session: Session) -> None:
        pass

    def release(self, session: Session) -> None:
        session.worker = None


async def test_idle_ttl_expiry_with_autojump_clock(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = server_context(
        create_app(
            Settings(workers=("http://127.0.0.1:9",), session_ttl_s=10, keep_closed_s=60),
            worker_tls=TLS,
        )
    )
    ctx.store = SessionStore(SessionRegistry(clock=trio.current_time), Unpinned())
    expiry = Expiry(ctx.store, default_ttl_s=10, keep_closed_s=60, keep_collected_s=60)
    idle = ctx.registry.create("idle")
    short = ctx.registry.create("short", ttl_s=2)
    busy = ctx.registry.create("busy")
    slot = busy.claim(trio.current_time())

    async def in_flight_turn() -> None:
        # A generation longer than the TTL: the session is not idle meanwhile.
        await trio.sleep(25)
        busy.release(slot, trio.current_time())

    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expiry.forever)
            nursery.start_soon(in_flight_turn)
            await trio.sleep(5)
            assert short.state is SessionState.EXPIRED and idle.state is SessionState.OPEN
            await trio.sleep(6.5)  # between reaper ticks: no tie with them
            # Read through a call: the assert above narrowed `idle.state` for mypy.
            assert state_of(idle) is SessionState.EXPIRED
            assert idle.closed_at is not None
            await trio.sleep(12)  # t=23.5: the turn has run 23.5 s, twice the TTL
            assert state_of(busy) is SessionState.OPEN and busy.slot is slot
            await trio.sleep(10)  # t=33.5: released at 25, idle 8.5 s
            assert state_of(busy) is SessionState.OPEN and busy.slot is None
            await trio.sleep(3)  # t=36.5: idle 11.5 s
            assert state_of(busy) is SessionState.EXPIRED
            # Uncollected documents stay for --keep-closed-s, then go, loudly.
            await trio.sleep(34)  # t=70.5: idle closed at ~11 s, 59.5 s ago
            assert "idle" in {s.id for s in ctx.registry}
            await trio.sleep(10)
            assert "idle" not in {s.id for s in ctx.registry}
            nursery.cancel_scope.cancel()
    assert any("dropping expired session idle" in r.getMessage() for r in caplog.records)


async def test_expired_session_is_readable_until_collected(stack: Stack) -> None:
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    session = stack.ctx.registry.get(session_id)
    session.last_active_at -= 10_000  # idle for long
    stack.ctx.expiry.once()
    response = await stack.chat(session_id, messages=USER)
    assert response.status_code == 404 and response.json()["error"]["code"] == "session_not_found"
    doc = await stack.trajectory(session_id)
    assert doc["status"] == "expired" and len(doc["turns"]) == 1 and doc["closed_at"]
    listed = (await stack.client.get("/sessions", params={"state": "expired"})).json()
    assert [s["session_id"] for s in listed["sessions"]] == [session_id]
    collected = (await stack.client.delete(f"/sessions/{session_id}")).json()
    assert collected["status"] == "closed"
    assert collected["segments"][-1]["token_ids"] == doc["token_ids"]
    workers = (await stack.client.get("/workers")).json()["workers"]
    assert workers[0]["active_sessions"] == 0  # released once, not twice


async def test_max_sessions_is_429(make_stack: StackFactory) -> None:
    stack = await make_stack(max_sessions=2)
    await stack.create()
    await stack.create()
    response = await stack.client.post("/sessions")
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "too_many_sessions"


async def test_max_session_tokens_before_any_worker(make_stack: StackFactory) -> None:
    stack = await make_stack(max_session_tokens=20)
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER, max_tokens=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "--max-session-tokens" in response.json()["error"]["message"]
    assert stack.emulator.received == 0


async def test_api_key_guards_every_route_but_health(make_stack: StackFactory) -> None:
    stack = await make_stack(api_key="s3cret")
    # A client without the stack client's default Authorization header.
    bare = httpx.AsyncClient(base_url=stack.url, verify=TLS)
    assert (await bare.get("/health")).status_code == 200
    for method, path in [
        ("POST", "/sessions"),
        ("GET", "/sessions"),
        ("GET", "/workers"),
        ("GET", "/metrics"),
        ("POST", "/admin/pause"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = await bare.request(method, path, headers=headers)
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["code"] == "unauthorized"
    await bare.aclose()
    created = await stack.client.post("/sessions")
    assert created.status_code == 201
    base_url = stack.url + created.json()["base_url"]

    def agent(key: str) -> Any:
        client = openai.OpenAI(
            base_url=base_url,
            api_key=key,
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=TLS),
        )
        try:
            return client.chat.completions.create(model="m", messages=USER)
        finally:
            client.close()

    assert (await trio.to_thread.run_sync(agent, "s3cret")).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        await trio.to_thread.run_sync(agent, "nope")


async def test_pause_waits_for_inflight_then_holds_new_turns(make_stack: StackFactory) -> None:
    stack = await make_stack(emulator=EmulatorConfig(base_latency_s=0.3), pause_wait_s=0.2)
    first, second = await stack.create(), await stack.create()
    results: dict[str, Any] = {}

    async def turn(name: str, session_id: str) -> None:
        results[name] = await stack.chat(session_id, messages=USER)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn, "inflight", first)
        await stack.emulator.wait_for_requests(1)
        paused = await stack.client.post("/admin/pause")
        # Pausing returned only once the in-flight turn was done.
        assert paused.json()["inflight"] == 0 and paused.json()["mode"] == "drain"
        assert len(stack.ctx.registry.get(first).trajectory.turns) == 1
    assert results["inflight"].status_code == 200
    held = await stack.chat(second, messages=USER)
    assert held.status_code == 503 and held.json()["error"]["code"] == "server_paused"
    assert int(held.headers["retry-after"]) >= 1
    assert stack.emulator.received == 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn, "waiting", second)
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)
        assert "waiting" not in results and stack.emulator.received == 1
        resumed = await stack.client.post("/admin/resume")
        assert resumed.json() == {"paused": False, "weight_version": None}
    assert results["waiting"].status_code == 200


@pytest.mark.parametrize("how", ["delete", "expire"], ids=["deleted", "expired"])
async def test_a_turn_held_by_a_pause_is_refused_at_once_when_its_session_stops(
    make_stack: StackFactory, how: str
) -> None:
    """A turn waiting out a pause (up to --pause-wait-s, 600 s here) whose
    session a DELETE collects (or expiry closes) gets its 404 then, not a
    503 server_paused when the wait runs out."""
    stack = await make_stack(pause_wait_s=600)
    session_id = await stack.create()
    assert (await stack.client.post("/admin/pause")).status_code == 200
    results: list[httpx.Response] = []

    async def agent() -> None:
        results.append(await stack.chat(session_id, messages=USER))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent)
            await trio.testing.wait_all_tasks_blocked(cushion=0.02)
            assert stack.ctx.pause.held == 1 and not results
            if how == "delete":
                assert (await stack.client.delete(f"/sessions/{session_id}")).status_code == 200
            else:
                stack.ctx.store.expire(stack.ctx.registry.get(session_id))
    (answer,) = results
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "session_not_found"
    assert stack.ctx.pause.held == 0 and stack.ctx.pause.inflight == 0
    assert stack.emulator.received == 0
    # Other sessions' turns still wait for the resume.
    other = await stack.create()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: stack.chat(other, messages=USER))
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)
        assert stack.ctx.pause.held == 1
        await stack.client.post("/admin/resume")
    assert stack.emulator.received == 1


@pytest.mark.parametrize(
    ("version", "status"),
    [("v" * MAX_WEIGHT_VERSION_CHARS, 200), ("v" * (MAX_WEIGHT_VERSION_CHARS + 1), 400)],
    ids=["at-the-limit", "past-it"],
)
async def test_a_declared_weight_version_is_bounded(
    stack: Stack, version: str, status: int
) -> None:
    """It names the tokens of every turn sampled under it: each turn record
    (memory, journal, export) carries it."""
    assert (await stack.client.post("/admin/pause")).status_code == 200
    resumed = await stack.client.post("/admin/resume", json={"weight_version": version})
    assert resumed.status_code == status, resumed.text[:300]
    if status == 400:
        assert resumed.json()["error"]["param"] == "weight_version"
        assert stack.ctx.pause.paused and stack.ctx.pause.declared_version is None
    else:
        assert stack.ctx.pause.declared_version == version


async def test_metrics_count_turns_and_failures(make_stack: StackFactory) -> None:
    stack = await make_stack()
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    assert (await stack.chat(session_id, messages=USER, n=2)).status_code == 400
    stack.emulator.faults.fault = "nan_logprob"
    bad = await stack.chat(await stack.create(), messages=USER)
    assert bad.status_code == 502
    text = (await stack.client.get("/metrics")).text
    assert 'rollout_turns_total{code="ok",outcome="ok"} 1.0' in text
    assert 'rollout_turns_total{code="upstream_malformed",outcome="error"} 1.0' in text
    assert 'rollout_turns_total{code="invalid_request",outcome="error"} 1.0' in text
    assert 'rollout_validation_failures_total{kind="json"} 1.0' in text
    assert 'rollout_sessions{state="open"} 2.0' in text
    assert f'rollout_worker_healthy{{worker="{stack.emulator_url}"}} 1.0' in text
    assert "rollout_upstream_latency_seconds_count 1.0" in text
    assert 'rollout_tokens_committed_total{kind="sampled"}' in text


async def test_each_turn_records_weight_version(stack: Stack) -> None:
    session_id = await stack.create()
    await stack.chat(session_id, messages=USER)
    doc = await stack.trajectory(session_id)
    assert doc["turns"][0]["weight_version"] == stack.emulator.config.weight_version
