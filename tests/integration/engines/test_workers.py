"""The worker pool end to end: sticky dispatch, health, failover, admin routes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
import trio

from rollout_session.emulator import EmulatorConfig
from rollout_session.engines.pool import Health
from tests.conftest import Stack, StackFactory, spawn_worker
from tests.integration.session.test_turns import check_document, echo
from tests.loopback import TLS

USER_NEXT = {"role": "user", "content": "next"}
FAST_HEALTH = {
    "health_interval_s": 0.05,
    "health_timeout_s": 0.5,
    "unhealthy_after": 2,
    "healthy_after": 2,
}


async def converse(stack: Stack, session_id: str, turns: int, start: int = 0) -> list[Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    answers = []
    for i in range(start):
        messages += [{"role": "assistant", "content": "x"}, {"role": "user", "content": str(i)}]
    for i in range(turns):
        response = await stack.chat(session_id, messages=messages, seed=i)
        assert response.status_code == 200, response.text
        answers.append(response.json())
        messages += [
            echo(answers[-1]["choices"][0]["message"]),
            {"role": "user", "content": f"turn {i}"},
        ]
    return answers


async def test_sticky_sessions_are_balanced_and_stay_on_one_worker(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(num_workers=3)
    ids = [await stack.create() for _ in range(30)]
    async with trio.open_nursery() as nursery:
        for session_id in ids:
            nursery.start_soon(converse, stack, session_id, 5)
    per_worker: Counter[str] = Counter()
    for session_id in ids:
        doc = await stack.trajectory(session_id)
        check_document(doc)
        workers = {t["worker"] for t in doc["turns"]}
        assert len(workers) == 1 and len(doc["turns"]) == 5
        per_worker[workers.pop()] += 1
    assert set(per_worker) == {w.url for w in stack.workers}
    assert max(per_worker.values()) - min(per_worker.values()) <= 1
    # Each worker saw exactly the turns of its own sessions.
    for worker in stack.workers:
        assert worker.emulator.received == 5 * per_worker[worker.url]
    listed = (await stack.client.get("/workers")).json()["workers"]
    assert sorted(w["active_sessions"] for w in listed) == sorted(per_worker.values())


async def test_dead_worker_sessions_fail_over_and_worker_heals(
    make_stack: StackFactory, text_model: Any, nursery: trio.Nursery
) -> None:
    stack = await make_stack(num_workers=2, **FAST_HEALTH)
    ids = [await stack.create() for _ in range(4)]
    for session_id in ids:
        await converse(stack, session_id, 1)
    before = {sid: await stack.trajectory(sid) for sid in ids}
    dead = stack.workers[0]
    dead.kill()
    pool = stack.ctx.pool
    with trio.fail_after(10):
        await pool.wait_for_health(dead.url, healthy=False)
    # Every session continues, the moved ones on the other worker.
    for session_id in ids:
        messages = [*before[session_id]["messages"], {"role": "user", "content": "next"}]
        response = await stack.chat(session_id, messages=messages)
        assert response.status_code == 200, response.text
        doc = await stack.trajectory(session_id)
        check_document(doc)
        old = before[session_id]["token_ids"]
        assert doc["token_ids"][: len(old)] == old
        assert doc["turns"][-1]["worker"] == stack.workers[1].url
    # The worker comes back on the same port and heals.
    revived = await spawn_worker(nursery, text_model, EmulatorConfig(), port=dead.port)
    with trio.fail_after(10):
        await pool.wait_for_health(dead.url, healthy=True)
    fresh = await stack.create()
    await converse(stack, fresh, 1)
    assert revived.emulator.received == 1  # least-loaded: the healed worker


async def test_connect_refused_is_retried_transparently(make_stack: StackFactory) -> None:
    stack = await make_stack(num_workers=2)
    session_id = await stack.create()
    await converse(stack, session_id, 1)
    pinned = stack.ctx.registry.get(session_id).worker
    victim = next(w for w in stack.workers if w.url == pinned)
    victim.kill()  # no health check noticed yet: the next turn meets a refused connect
    doc = await stack.trajectory(session_id)
    response = await stack.chat(
        session_id, messages=[*doc["messages"], {"role": "user", "content": "again"}]
    )
    assert response.status_code == 200, response.text
    after = await stack.trajectory(session_id)
    assert [t["worker"] for t in after["turns"]] == [
        pinned,
        stack.ctx.registry.get(session_id).worker,
    ]
    assert after["turns"][1]["worker"] != pinned


async def test_turn_in_flight_when_worker_dies_is_502_then_retry_succeeds(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(num_workers=2, emulator=EmulatorConfig(base_latency_s=30))
    session_id = await stack.create()
    result: list[Any] = []

    async def turn() -> None:
        result.append(await stack.chat(session_id, messages=[{"role": "user", "content": "x"}]))

    # Equal load: the first worker in pool order takes the new session.
    busy = stack.workers[0]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await busy.emulator.wait_for_requests(1)
        busy.kill()
    assert result[0].status_code == 502
    assert result[0].json()["error"]["code"] == "upstream_error"
    session = stack.ctx.registry.get(session_id)
    assert session.slot is None and session.trajectory.turns == []
    other = next(w for w in stack.workers if w is not busy)
    other.emulator.config = EmulatorConfig()  # answer at once from now on
    response = await stack.chat(session_id, messages=[{"role": "user", "content": "x"}])
    assert response.status_code == 200
    assert (await stack.trajectory(session_id))["turns"][0]["worker"] == other.url


async def test_no_healthy_worker_is_503_with_retry_after(make_stack: StackFactory) -> None:
    stack = await make_stack(**FAST_HEALTH)
    session_id = await stack.create()
    stack.workers[0].kill()
    with trio.fail_after(10):
        await stack.ctx.pool.wait_for_health(stack.emulator_url, healthy=False)
    response = await stack.chat(session_id, messages=[{"role": "user", "content": "x"}])
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_worker"
    assert int(response.headers["retry-after"]) >= 1
    health = (await stack.client.get("/health")).json()
    assert health["workers"] == {"healthy": 0, "total": 1}


async def test_admin_add_and_drain_a_worker_with_a_turn_in_flight(
    make_stack: StackFactory, text_model: Any, nursery: trio.Nursery
) -> None:
    stack = await make_stack()
    slow = await spawn_worker(nursery, text_model, EmulatorConfig(base_latency_s=0.5))
    added = await stack.client.post("/workers", json={"url": slow.url})
    assert added.status_code == 201 and added.json()["url"] == slow.url
    # Checked at once: a worker of the served model is admitted before the
    # answer, and takes sessions from then on.
    assert added.json()["state"] == "healthy" and added.json()["healthy"]
    again = await stack.client.post("/workers", json={"url": slow.url})
    assert again.status_code == 409 and again.json()["error"]["code"] == "worker_exists"
    # Fill the first worker so the next session is pinned to the slow one.
    busy = await stack.create()
    await converse(stack, busy, 1)
    session_id = await stack.create()
    results: dict[str, Any] = {}

    async def turn() -> None:
        results["turn"] = await stack.chat(session_id, messages=[{"role": "user", "content": "x"}])

    async with trio.open_nursery() as inner:
        inner.start_soon(turn)
        await slow.emulator.wait_for_requests(1)
        removed = await stack.client.delete("/workers", params={"url": slow.url})
        # The drain waited for the in-flight turn.
        assert "turn" in results and results["turn"].status_code == 200
    assert removed.status_code == 200 and removed.json()["draining"]
    urls = [w["url"] for w in (await stack.client.get("/workers")).json()["workers"]]
    assert urls == [stack.emulator_url]
    # Its session re-pins on the next turn.
    doc = await stack.trajectory(session_id)
    await stack.chat(session_id, messages=[*doc["messages"], {"role": "user", "content": "y"}])
    assert (await stack.trajectory(session_id))["turns"][1]["worker"] == stack.emulator_url
    missing = await stack.client.delete("/workers", params={"url": slow.url})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "worker_not_found"
    bad = await stack.client.post("/workers", json={"url": "ftp://x"})
    assert bad.status_code == 400


async def test_sglang_session_cache_hints_and_close(make_stack: StackFactory) -> None:
    stack = await make_stack(
        kv_sessions="hint", emulator=EmulatorConfig(enable_session_radix_cache=True)
    )
    session_id = await stack.create()
    await converse(stack, session_id, 2)
    assert [r.session_id for r in stack.emulator.requests] == [session_id, session_id]
    cache = stack.emulator.cache
    used = cache.used_tokens
    # SGLang's session radix cache: the session references its latest turn's path.
    assert 0 < cache.session_tokens(session_id) == cache.referenced_tokens <= used
    assert (await stack.client.delete(f"/sessions/{session_id}")).status_code == 200
    with trio.fail_after(10):
        await stack.emulator.wait_until(lambda: session_id in stack.emulator.sessions_closed)
    # Close dereferences: the KV stays cached, first in line for eviction.
    assert cache.session_tokens(session_id) == cache.referenced_tokens == 0
    assert cache.used_tokens == used


async def test_sglang_session_cache_closes_a_moved_session_on_its_old_worker(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(
        num_workers=2, kv_sessions="hint", emulator=EmulatorConfig(enable_session_radix_cache=True)
    )
    session_id = await stack.create()
    await converse(stack, session_id, 1)
    pool = stack.ctx.pool
    old = next(w for w in stack.workers if w.url == stack.ctx.registry.get(session_id).worker)
    new = next(w for w in stack.workers if w is not old)
    # The health checker gave up on the old worker (its /health timed out,
    # say) but it still runs and still holds the session's KV.
    pool.workers[old.url].health = Health.UNHEALTHY
    doc = await stack.trajectory(session_id)
    response = await stack.chat(session_id, messages=[*doc["messages"], USER_NEXT])
    assert response.status_code == 200, response.text
    assert (await stack.trajectory(session_id))["turns"][1]["worker"] == new.url
    with trio.fail_after(10):
        await old.emulator.wait_until(lambda: session_id in old.emulator.sessions_closed)
    assert new.emulator.sessions_closed == []
    # The old worker keeps the KV, unreferenced; the new one references the session.
    assert old.emulator.cache.used_tokens > 0 and old.emulator.cache.referenced_tokens == 0
    assert new.emulator.cache.session_tokens(session_id) > 0
    assert [pool.workers[w.url].active_sessions for w in (old, new)] == [0, 1]


async def test_a_proxy_in_the_environment_changes_neither_probes_nor_traffic(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A proxy that does not exist: whatever goes through it fails.
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    stack = await make_stack()
    # The test's own client must not take the proxy either.
    async with httpx.AsyncClient(base_url=stack.url, trust_env=False, verify=TLS) as client:
        created = await client.post("/sessions", json={})
        session_id = created.json()["session_id"]
        chat = await client.post(
            f"/sessions/{session_id}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 200, chat.text
        workers = (await client.get("/workers")).json()["workers"]
    assert [w["healthy"] for w in workers] == [True]
