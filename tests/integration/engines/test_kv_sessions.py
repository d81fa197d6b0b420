"""Worker-side sessions (`--kv-sessions hint`) and priority
(docs/kv-sessions.md): what reaches the worker, and that every worker-side
session is closed — on DELETE, on expiry, on a move and at shutdown (a failed
close is logged once per worker and counted: test_upstream_model.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from rollout_session.client import SessionClient
from rollout_session.emulator.worker import EmulatorConfig
from tests.conftest import Stack, StackFactory

USER = [{"role": "user", "content": "hello"}]


async def one_turn(stack: Stack, session_id: str, **extra: Any) -> None:
    response = await stack.chat(session_id, messages=USER, **extra)
    assert response.status_code == 200, response.text


def bodies(stack: Stack) -> list[dict[str, Any]]:
    return [r.body for w in stack.workers for r in w.emulator.requests if r.route == "chat"]


async def test_a_sessions_priority_is_sent_over_the_agents(make_stack: StackFactory) -> None:
    stack = await make_stack(default_priority=5)
    defaulted, own = await stack.create(), await stack.create(priority=-3)
    await one_turn(stack, defaulted, priority=100)  # the agent's own is overridden
    await one_turn(stack, own)
    assert [b["priority"] for b in bodies(stack)] == [5, -3]
    summary = (await stack.client.get(f"/sessions/{own}")).json()
    assert summary["priority"] == -3


async def test_the_client_creates_a_session_with_a_priority(stack: Stack) -> None:
    async with SessionClient([stack.url]) as client:
        handle = await client.create(priority=2)
    await one_turn(stack, handle.session_id)
    assert bodies(stack)[0]["priority"] == 2


async def test_without_a_priority_the_agents_own_passes_through(stack: Stack) -> None:
    await one_turn(stack, await stack.create())
    await one_turn(stack, await stack.create(), priority=7)
    sent = bodies(stack)
    assert "priority" not in sent[0] and sent[1]["priority"] == 7


@pytest.mark.parametrize(
    "priority",
    [1 << 63, -(1 << 63) - 1, True, 1.5, "1"],
    ids=["big", "small", "bool", "float", "str"],
)
async def test_a_priority_sglang_would_refuse_is_400(stack: Stack, priority: Any) -> None:
    response = await stack.client.post("/sessions", json={"priority": priority})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"
    assert (await stack.client.get("/sessions")).json()["sessions"] == []


async def test_priority_survives_a_restart(make_stack: StackFactory, tmp_path: Path) -> None:
    stack = await make_stack(journal=str(tmp_path), journal_fsync="always")
    session_id = await stack.create(priority=9)
    await stack.server.aclose()
    again = await make_stack(journal=str(tmp_path))
    await one_turn(again, session_id)
    assert bodies(again)[0]["priority"] == 9


async def test_hint_closes_every_worker_session_at_shutdown(make_stack: StackFactory) -> None:
    stack = await make_stack(kv_sessions="hint")
    ids = [await stack.create() for _ in range(3)]
    for session_id in ids:
        await one_turn(stack, session_id)
    assert [b["session_id"] for b in bodies(stack)] == ids
    await stack.server.aclose()
    assert sorted(stack.emulator.sessions_closed) == sorted(ids)


async def test_hint_trusts_a_worker_with_the_session_radix_cache(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        stack = await make_stack(
            kv_sessions="hint", emulator=EmulatorConfig(enable_session_radix_cache=True)
        )
        pool, url = stack.ctx.pool, stack.workers[0].url
        with trio.fail_after(10):
            await pool.wait_until(lambda: pool.get(url).session_hints is not None)
    assert pool.get(url).session_hints is True
    assert not [r for r in caplog.records if "session_radix" in r.getMessage()]
    # Its turns take a reference on the worker; the DELETE drops it.
    session_id = await stack.create()
    await one_turn(stack, session_id)
    cache = stack.emulator.cache
    assert cache.session_tokens(session_id) > 0
    assert (await stack.client.delete(f"/sessions/{session_id}")).status_code == 200
    with trio.fail_after(10):
        await stack.emulator.wait_until(lambda: cache.session_tokens(session_id) == 0)
    assert cache.used_tokens > 0  # dereferenced, not freed


async def test_hint_warns_about_a_worker_that_ignores_session_ids(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        stack = await make_stack(kv_sessions="hint")
        pool, url = stack.ctx.pool, stack.workers[0].url
        with trio.fail_after(10):
            await pool.wait_until(lambda: pool.get(url).session_hints is not None)
    assert pool.get(url).session_hints is False
    (warning,) = [r.getMessage() for r in caplog.records if "session_radix" in r.getMessage()]
    assert url in warning
    worker = (await stack.client.get("/workers")).json()["workers"][0]
    assert worker["session_hints"] is False
