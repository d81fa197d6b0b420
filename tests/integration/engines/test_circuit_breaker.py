"""A worker failing real traffic behind a healthy ``/health`` is fenced.

``--circuit-failures`` failed turns in a row (a 5xx, a transport error, an
answer over ``--max-answer-mb``, an answer failing validation) open its
circuit: no new pins, and its sessions re-pin on their next turn. Failures
the worker answered open it when they come from ``--circuit-sessions``
sessions, or once its chat probe fails too: one agent's requests that make
a worker fail are not the worker's fault. After
``--circuit-open-s`` the pool probes its chat route; ``--circuit-successes``
passed probes in a row close the circuit, a failed one reopens it.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from rollout_session.emulator.faults import FaultPicker
from rollout_session.engines.pool import Circuit, Health, Worker
from tests.conftest import Stack, StackFactory

USER = [{"role": "user", "content": "hello"}]
# /health every 50 ms, so the worker is probed healthy many times over.
FAST: dict[str, Any] = {"health_interval_s": 0.05, "health_timeout_s": 1.0}
N = 5  # the default --circuit-failures (sgl-model-gateway's)

# fault → what the agent gets for each failed turn
FAULTS = {
    "http_500": (500, None),
    "nan_logprob": (502, "upstream_malformed"),
    "drop_connection": (502, "upstream_error"),
    "endless_body": (502, "upstream_malformed"),
}


def break_worker(stack: Stack, index: int, fault: str | None) -> None:
    stack.workers[index].emulator.faults = FaultPicker(fault, 1.0, 0)


def pool_worker(stack: Stack, index: int) -> Worker:
    return stack.ctx.pool.get(stack.workers[index].url)


async def next_turn(stack: Stack, session_id: str) -> Any:
    doc = await stack.trajectory(session_id)
    messages = [*doc["messages"], {"role": "user", "content": "again"}] if doc["turns"] else USER
    return await stack.chat(session_id, messages=messages)


@pytest.mark.parametrize("fault", FAULTS, ids=FAULTS)
async def test_a_worker_failing_turns_behind_a_healthy_health_is_fenced(
    make_stack: StackFactory, fault: str
) -> None:
    stack = await make_stack(num_workers=2, max_answer_mb=4, circuit_open_s=3600, **FAST)
    pool = stack.ctx.pool
    broken = pool_worker(stack, 0)
    break_worker(stack, 0, fault)
    # Pool order breaks the tie: the first session is pinned to the broken worker.
    session_id = await stack.create()
    status, code = FAULTS[fault]
    for _ in range(N):
        response = await stack.chat(session_id, messages=USER)
        assert response.status_code == status, response.text
        if code is not None:
            assert response.json()["error"]["code"] == code
    # A transport error opens it at once; an answered failure once the chat
    # probe fails too.
    with trio.fail_after(10):
        await pool.wait_until(lambda: broken.circuit is Circuit.OPEN)
    probed = fault != "drop_connection"
    assert broken.circuit_excused == 0
    # Its /health still answers: only the circuit fences it.
    probes = broken.last_checked_at
    with trio.fail_after(10):
        await pool.wait_until(lambda: broken.last_checked_at != probes)
    assert broken.health is Health.HEALTHY and not broken.healthy
    # The session re-pins on its next turn, and new sessions avoid the worker
    # though it holds the fewest sessions.
    response = await next_turn(stack, session_id)
    assert response.status_code == 200, response.text
    doc = await stack.trajectory(session_id)
    assert [t["worker"] for t in doc["turns"]] == [stack.workers[1].url]
    for _ in range(3):
        response = await next_turn(stack, await stack.create())
        assert response.status_code == 200
    assert stack.workers[0].emulator.received == N + probed
    assert broken.active_sessions == 0 and pool_worker(stack, 1).active_sessions == 4
    listed = {w["url"]: w for w in (await stack.client.get("/workers")).json()["workers"]}
    assert listed[broken.url]["circuit"] == "open" and not listed[broken.url]["healthy"]
    assert (await stack.client.get("/health")).json()["workers"] == {"healthy": 1, "total": 2}


async def test_successes_reset_the_count(make_stack: StackFactory) -> None:
    """Only failures in a row open the circuit."""
    stack = await make_stack(circuit_failures=3)
    session_id = await stack.create()
    for fault in ("http_500", "http_500", None, "http_500", "http_500", None):
        break_worker(stack, 0, fault)
        response = await next_turn(stack, session_id)
        assert response.status_code == (500 if fault else 200)
    assert pool_worker(stack, 0).circuit is Circuit.CLOSED


async def test_half_open_probes_close_the_circuit_or_reopen_it(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(
        num_workers=2, circuit_failures=2, circuit_successes=2, circuit_open_s=0.2, **FAST
    )
    pool = stack.ctx.pool
    broken = pool_worker(stack, 0)
    emulator = stack.workers[0].emulator
    break_worker(stack, 0, "http_500")
    session_id = await stack.create()
    for _ in range(2):
        assert (await stack.chat(session_id, messages=USER)).status_code == 500
    with trio.fail_after(10):  # once the confirming probe failed
        await pool.wait_until(lambda: broken.circuit is Circuit.OPEN)
    first_opened = broken.circuit_opened_at
    # Still broken: the half-open probe fails and the circuit opens again.
    with trio.fail_after(10):
        await pool.wait_until(
            lambda: broken.circuit is Circuit.OPEN and broken.circuit_opened_at > first_opened
        )
    probe = emulator.requests[-1]
    assert probe.body["input_ids"] == [0] and probe.body["max_tokens"] == 1
    assert probe.session_id is None  # a probe, never an agent's session
    # Repaired: probes pass and close the circuit.
    break_worker(stack, 0, None)
    with trio.fail_after(10):
        await pool.wait_until(lambda: broken.circuit is Circuit.CLOSED)
    assert broken.healthy and broken.circuit_failures == 0
    chats = [r for r in emulator.requests if r.body.get("input_ids") != [0]]
    assert len(chats) == 2  # no agent's turn was used to test it
    # Its session, still pinned there, takes its next turn there.
    response = await next_turn(stack, session_id)
    assert response.status_code == 200
    assert emulator.requests[-1].body["input_ids"] != [0]  # an agent's turn, not a probe
    doc = await stack.trajectory(session_id)
    assert [t["worker"] for t in doc["turns"]] == [broken.url]


async def test_an_answer_failing_validation_counts_once(make_stack: StackFactory) -> None:
    """The turn path reports a malformed answer; a valid one resets the count."""
    stack = await make_stack(circuit_failures=2)
    session_id = await stack.create()
    break_worker(stack, 0, "positive_logprob")
    response = await next_turn(stack, session_id)
    assert response.json()["error"]["code"] == "upstream_malformed"
    worker = pool_worker(stack, 0)
    assert worker.circuit_failures == 1
    assert str(worker.last_error).startswith("turn: logprob: ")  # the failure's kind
    break_worker(stack, 0, None)
    response = await next_turn(stack, session_id)
    assert response.status_code == 200
    assert worker.circuit_failures == 0
    assert len((await stack.trajectory(session_id))["turns"]) == 1


async def test_one_agents_failing_requests_do_not_fence_the_worker(
    make_stack: StackFactory,
) -> None:
    """A hostile session whose every request makes the only worker answer 500
    reaches the count on its own, again and again: each time the chat probe
    passes, and healthy sessions beside it never see 503."""
    stack = await make_stack(**FAST)
    pool = stack.ctx.pool
    worker = pool_worker(stack, 0)

    def hostile(body: Any) -> bool:  # the request's content causes the fault
        return isinstance(body, dict) and body.get("temperature") == 1.25

    stack.workers[0].emulator.faults = FaultPicker("http_500", 1.0, 0, only=hostile)
    attacker = await stack.create()

    async def attack() -> None:
        for _ in range(2 * N):
            response = await stack.chat(attacker, messages=USER, temperature=1.25)
            assert response.status_code == 500, response.text

    async def work(session_id: str) -> None:
        for _ in range(3):
            response = await next_turn(stack, session_id)
            assert response.status_code == 200, response.text

    await attack()  # alone: its failures are in a row
    with trio.fail_after(10):
        await pool.wait_until(lambda: not worker.probing)
    assert worker.circuit is Circuit.CLOSED and worker.circuit_excused >= 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(attack)
        for _ in range(3):
            nursery.start_soon(work, await stack.create())
    with trio.fail_after(10):
        await pool.wait_until(lambda: not worker.probing)
    assert worker.circuit is Circuit.CLOSED and worker.healthy
    metrics = (await stack.client.get("/metrics")).text
    excused = f'rollout_worker_circuit_excused_total{{worker="{worker.url}"}} '
    assert f"{excused}{float(worker.circuit_excused)}" in metrics


async def test_a_worker_failing_real_prompts_but_passing_its_probe_is_fenced(
    make_stack: StackFactory,
) -> None:
    """A sick worker (out of memory on real prompts) answers the one-token
    probe: its failures, from several sessions, open its circuit anyway,
    and new sessions go to the healthy worker. (One session's failures are
    still excused: the test above.)"""
    stack = await make_stack(num_workers=2, circuit_open_s=3600, **FAST)
    sick = pool_worker(stack, 0)

    def real_prompt(body: Any) -> bool:  # the probe asks for one token of one id
        return isinstance(body, dict) and body.get("input_ids") != [0]

    stack.workers[0].emulator.faults = FaultPicker("http_500", 1.0, 0, only=real_prompt)
    # Sessions go to the least loaded worker: every other one lands on the sick one.
    failed = 0
    while sick.circuit is Circuit.CLOSED:
        response = await stack.chat(await stack.create(), messages=USER)
        failed += response.status_code == 500
        assert failed <= N, "the sick worker was never fenced"
    assert failed == N and sick.circuit_excused == 0
    assert "failed turns of" in str(sick.last_error)
    assert not sick.probing  # opened without asking the probe
    for _ in range(8):
        response = await stack.chat(await stack.create(), messages=USER)
        assert response.status_code == 200, response.text
