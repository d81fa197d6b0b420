"""The circuit breaker against a bare worker (`origin.Origin`): failed turns
open it, a passing probe excuses answered failures, half-open probes close
or reopen it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import trio

from rollout_session.engines.pool.circuit import Breaker
from rollout_session.engines.pool.health import HealthChecks
from rollout_session.engines.pool.membership import Membership
from rollout_session.engines.pool.worker import Circuit, Worker
from tests.unit.engines.pool.origin import Origin, paths
from tests.unit.engines.pool.parts import options

Parts = tuple[Membership, Breaker, Worker]


@pytest.fixture
async def admitted(
    origin: Origin, nursery: trio.Nursery
) -> AsyncIterator[Callable[..., Awaitable[Parts]]]:
    """Makes a breaker over one admitted worker at `origin`, the pool running
    in `nursery`; closes their connections after the test."""
    made: list[tuple[Membership, httpx.AsyncClient]] = []

    async def make(**changes: object) -> Parts:
        opts = options(**changes)
        members = Membership(opts, httpx.create_ssl_context(trust_env=False))
        members.nursery = nursery
        probes = httpx.AsyncClient()
        made.append((members, probes))
        health = HealthChecks(members, opts, probes, clock=lambda: 0.0)
        worker = members.add(origin.url)
        await health.round()
        assert worker.healthy
        return members, Breaker(members, opts, health), worker

    yield make
    for members, probes in made:
        await members.aclose()
        await probes.aclose()


async def test_transport_failures_open_it_at_the_count(
    origin: Origin, admitted: Callable[..., Awaitable[Parts]]
) -> None:
    _, breaker, worker = await admitted(circuit_failures=3)
    breaker.failed(worker, "refused", answered=False, session="s")
    breaker.failed(worker, "refused", answered=False, session="s")
    breaker.succeeded(worker)  # a success in between starts the count over
    assert worker.circuit_failures == 0
    for _ in range(3):
        breaker.failed(worker, "refused", answered=False, session="s")
    assert worker.circuit is Circuit.OPEN and worker.last_error == "turn: refused"
    assert b"/probe" not in paths(origin)  # a dead connection is not excused


async def test_answered_failures_are_excused_when_the_probe_passes(
    origin: Origin, admitted: Callable[..., Awaitable[Parts]]
) -> None:
    members, breaker, worker = await admitted(circuit_failures=2)
    for _ in range(2):
        breaker.failed(worker, "answered 500", answered=True, session="s")
    assert worker.probing and worker.circuit is Circuit.CLOSED
    await members.wait_until(lambda: worker.circuit_excused == 1)
    assert worker.circuit is Circuit.CLOSED and worker.circuit_failures == 0
    assert paths(origin).count(b"/probe") == 1


async def test_answered_failures_open_it_when_the_probe_fails(
    origin: Origin, admitted: Callable[..., Awaitable[Parts]]
) -> None:
    origin.routes[b"/probe"] = (500, b"{}")
    members, breaker, worker = await admitted(circuit_failures=2)
    for _ in range(2):
        breaker.failed(worker, "answered 500", answered=True, session="s")
    await members.wait_until(lambda: worker.circuit is Circuit.OPEN)
    assert worker.last_error == "turn: answered 500; probe answered 500"


def circuit_of(worker: Worker) -> Circuit:
    """The worker's circuit now (read through a call: it changes under the test)."""
    return worker.circuit


async def test_half_open_probes_close_it_or_reopen_it(
    origin: Origin, admitted: Callable[..., Awaitable[Parts]]
) -> None:
    members, breaker, worker = await admitted(
        circuit_failures=1, circuit_successes=2, circuit_open_s=30.0
    )
    breaker.failed(worker, "refused", answered=False, session="s")
    assert circuit_of(worker) is Circuit.OPEN
    breaker.test(worker)
    assert circuit_of(worker) is Circuit.OPEN  # not open long enough
    worker.circuit_opened_at -= 30  # as if 30 s went by
    origin.routes[b"/probe"] = (500, b"{}")
    breaker.test(worker)
    assert circuit_of(worker) is Circuit.HALF_OPEN
    await members.wait_until(lambda: circuit_of(worker) is Circuit.OPEN)  # the probe failed
    worker.circuit_opened_at -= 30
    del origin.routes[b"/probe"]
    for passed in (1, 2):
        breaker.test(worker)
        await members.wait_until(
            lambda n=passed: (
                worker.circuit_successes == n  # type: ignore[misc]
                or circuit_of(worker) is Circuit.CLOSED
            )
        )
    assert circuit_of(worker) is Circuit.CLOSED
    assert paths(origin).count(b"/probe") == 3


async def test_failures_of_several_sessions_open_it_though_the_probe_passes(
    origin: Origin, admitted: Callable[..., Awaitable[Parts]]
) -> None:
    """A worker that fails real prompts (out of memory) but answers the
    one-token probe: its failures come from many sessions."""
    _, breaker, worker = await admitted(circuit_failures=3, circuit_sessions=3)
    for session in ("a", "b", "c"):
        breaker.failed(worker, "answered 500", answered=True, session=session)
    assert worker.circuit is Circuit.OPEN and not worker.probing
    assert worker.last_error == "turn: answered 500 (failed turns of 3 sessions in a row)"
    assert b"/probe" not in paths(origin)


async def test_fewer_sessions_failures_are_probed_and_excused(
    origin: Origin, admitted: Callable[..., Awaitable[Parts]]
) -> None:
    members, breaker, worker = await admitted(circuit_failures=3, circuit_sessions=3)
    for session in ("a", "b", "a"):
        breaker.failed(worker, "answered 500", answered=True, session=session)
    await members.wait_until(lambda: worker.circuit_excused == 1)
    assert worker.circuit is Circuit.CLOSED and not worker.failing_sessions
    # A success in between forgets who failed.
    breaker.failed(worker, "answered 500", answered=True, session="a")
    breaker.failed(worker, "answered 500", answered=True, session="b")
    breaker.succeeded(worker)
    assert worker.circuit_failures == 0 and not worker.failing_sessions
