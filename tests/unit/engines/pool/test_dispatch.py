"""One request's path through the pool against bare workers (`origin.Origin`):
the pin, failover, the 200's check, and what counts on the circuit."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio

from rollout_session.engines.pool import Check, WorkerPool, WorkerRequest
from rollout_session.engines.pool.worker import Health
from rollout_session.errors import UpstreamError, UpstreamMalformed
from tests.unit.engines.pool.origin import ANSWER, Origin, paths
from tests.unit.engines.pool.parts import Inline, Session, check_ok, options

MakePool = Callable[..., Awaitable[tuple[WorkerPool, Inline]]]


def refused_url() -> str:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def make_pool(nursery: trio.Nursery) -> AsyncIterator[MakePool]:
    """A running pool of the given workers, every one admitted."""
    pools: list[WorkerPool] = []

    async def make(*urls: str, **changes: object) -> tuple[WorkerPool, Inline]:
        validation = Inline()
        pool = WorkerPool(options(**changes), validation)
        pools.append(pool)
        for url in urls:
            pool.add(url)
        await nursery.start(pool.run)
        await pool.model_info()
        for worker in pool.workers.values():
            worker.health = Health.HEALTHY  # a refused port fails its probe: admit it anyway
        return pool, validation

    yield make
    for pool in pools:
        await pool.aclose()


def checked(path: str = "/turn", **fields: object) -> WorkerRequest[bytes]:
    return WorkerRequest(path=path, body=b"{}", check=Check(check_ok, None), **fields)  # type: ignore[arg-type]


async def test_a_checked_200_pins_the_session_and_counts_as_a_success(
    origin: Origin, make_pool: MakePool
) -> None:
    pool, validation = await make_pool(origin.url)
    worker = pool.get(origin.url)
    worker.circuit_failures = 2  # failures before it: a success starts the count over
    session = Session("s1")
    sent = await pool.send(session, checked(request_id="r1"))
    assert sent.checked == ANSWER and sent.reply.worker == origin.url
    assert session.worker == origin.url and worker.active_sessions == 1
    assert validation.checks == 1 and worker.circuit_failures == 0
    assert worker.inflight == 0 and worker.requests == set()
    _, target, headers = origin.requests[-1]
    assert (target, headers[b"x-smg-routing-key"]) == (b"/turn", b"s1")


@pytest.mark.parametrize(
    ("status", "body", "counts"),
    [(200, b'{"other": 1}', True), (500, b"{}", True), (400, b"{}", False)],
    ids=["fails-its-check", "5xx", "4xx"],
)
async def test_what_counts_against_the_worker(
    origin: Origin, make_pool: MakePool, status: int, body: bytes, counts: bool
) -> None:
    origin.routes[b"/turn"] = (status, body)
    pool, _ = await make_pool(origin.url)
    if status == 200:
        with pytest.raises(UpstreamMalformed):
            await pool.send(Session("s1"), checked())
    else:
        sent = await pool.send(Session("s1"), checked())
        assert sent.reply.status == status and sent.answer is None  # unchecked
    assert pool.get(origin.url).circuit_failures == int(counts)


async def test_a_refused_connection_is_sent_to_another_worker(
    origin: Origin, make_pool: MakePool
) -> None:
    dead = refused_url()
    pool, _ = await make_pool(dead, origin.url)
    session = Session("s1", worker=dead)
    pool.adopt(session)
    sent = await pool.send(session, checked())
    assert sent.reply.worker == origin.url and session.worker == origin.url
    assert pool.get(dead).active_sessions == 0 and pool.get(origin.url).active_sessions == 1
    assert pool.get(dead).circuit_failures == 1  # nothing was sent: a transport failure


async def test_a_follow_up_goes_to_its_worker_or_fails(origin: Origin, make_pool: MakePool) -> None:
    pool, validation = await make_pool(origin.url)
    session = Session("s1")
    parse: WorkerRequest[None] = WorkerRequest(path="/parse", body=b"{}", worker=origin.url)
    sent = await pool.send(session, parse)
    assert sent.answer is None and validation.checks == 0  # no check: counts neither way
    assert session.worker is None  # a follow-up pins nothing
    with pytest.raises(UpstreamError, match="left the pool"):
        await pool.send(session, WorkerRequest(path="/parse", body=b"{}", worker=refused_url()))


async def test_while_interrupted_new_requests_wait_and_follow_ups_do_not(
    origin: Origin, make_pool: MakePool
) -> None:
    pool, _ = await make_pool(origin.url)
    await pool.interrupt()
    follow_up: WorkerRequest[None] = WorkerRequest(path="/parse", body=b"{}", worker=origin.url)
    assert (await pool.send(Session("s1"), follow_up)).reply.status == 200
    sent: list[object] = []

    async def turn() -> None:
        sent.append(await pool.send(Session("s2"), checked()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [] and b"/turn" not in paths(origin)
        pool.resume_sending()
    assert len(sent) == 1


async def test_no_worker_left_after_a_refusal_is_an_upstream_error(
    origin: Origin, make_pool: MakePool
) -> None:
    dead = refused_url()
    pool, _ = await make_pool(origin.url, dead)
    pool.get(origin.url).draining = True  # takes no new pin: the dead one is all there is
    with pytest.raises(UpstreamError, match="cannot connect"):
        await pool.send(Session("s1"), checked())
