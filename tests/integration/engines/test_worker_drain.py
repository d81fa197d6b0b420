"""``DELETE /workers`` drains a worker; a drain, once begun, completes even
when the operator's client gives up waiting for it."""

from __future__ import annotations

from typing import Any

import trio

from rollout_session.emulator import EmulatorConfig, TextModel
from tests.conftest import StackFactory, spawn_worker

USER = [{"role": "user", "content": "hello"}]


async def test_a_drain_whose_client_gives_up_still_completes(
    make_stack: StackFactory, text_model: TextModel, nursery: trio.Nursery
) -> None:
    stack = await make_stack()
    pool = stack.ctx.pool
    # Its turns take long enough for the DELETE to be abandoned mid-drain.
    slow = await spawn_worker(nursery, text_model, EmulatorConfig(base_latency_s=2))
    assert (await stack.client.post("/workers", json={"url": slow.url})).status_code == 201
    with trio.fail_after(10):
        await pool.wait_for_health(slow.url, healthy=True)
    busy = await stack.create()
    assert (await stack.chat(busy, messages=USER)).status_code == 200
    session_id = await stack.create()  # the fewest sessions: the slow worker's
    results: dict[str, Any] = {}

    async def turn() -> None:
        results["turn"] = await stack.chat(session_id, messages=USER)

    async def delete() -> None:
        results["delete"] = await stack.client.delete("/workers", params={"url": slow.url})

    async with trio.open_nursery() as agents:
        agents.start_soon(turn)
        await slow.emulator.wait_for_requests(1)
        with trio.CancelScope() as give_up:
            async with trio.open_nursery() as operator:
                operator.start_soon(delete)
                await pool.wait_until(lambda: pool.get(slow.url).draining)
                give_up.cancel()  # the operator's client closes its connection
        assert "delete" not in results and "turn" not in results
    # The turn finished on the draining worker, and the drain completed.
    assert results["turn"].status_code == 200
    with trio.fail_after(10):
        await pool.wait_until(lambda: slow.url not in pool.workers)
    listed = (await stack.client.get("/workers")).json()["workers"]
    assert [w["url"] for w in listed] == [stack.emulator_url]
    missing = await stack.client.delete("/workers", params={"url": slow.url})
    assert missing.status_code == 404
    # Its session moves on its next turn.
    doc = await stack.trajectory(session_id)
    response = await stack.chat(session_id, messages=[*doc["messages"], *USER])
    assert response.status_code == 200
    turns = (await stack.trajectory(session_id))["turns"]
    assert [t["worker"] for t in turns] == [slow.url, stack.emulator_url]
