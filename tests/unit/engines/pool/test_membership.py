"""Who is in the pool: joining, lookups by any spelling, draining, and the
change signal tests and tools wait on."""

from __future__ import annotations

import httpx
import pytest
import trio

from rollout_session.engines.pool.membership import Membership
from rollout_session.engines.pool.worker import Circuit, Health
from rollout_session.engines.worker_urls import WorkerHosts
from rollout_session.errors import InvalidRequest, WorkerExists, WorkerNotFound
from tests.unit.engines.pool.parts import options

W1, W2 = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def members(**changes: object) -> Membership:
    return Membership(options(**changes), httpx.create_ssl_context(trust_env=False))


def test_a_worker_joins_once_by_its_canonical_url() -> None:
    pool = members()
    worker = pool.add(W1 + "/")
    assert worker.url == W1 and worker.health is Health.JOINING
    with pytest.raises(WorkerExists):
        pool.add(W1)
    assert pool.get(W1 + "/") is worker and pool.knows(W1) and not pool.knows(W2)
    with pytest.raises(WorkerNotFound):
        pool.get(W2)


@pytest.mark.parametrize(
    "url", ["ftp://127.0.0.1:9001", "http://10.0.0.9:9001", "not a url"], ids=str
)
def test_a_url_the_allow_list_refuses_is_an_invalid_request(url: str) -> None:
    pool = members(allowed_worker_hosts=WorkerHosts.parse(["127.0.0.1"]))
    with pytest.raises(InvalidRequest) as refused:
        pool.add(url)
    assert refused.value.param == "url"
    assert pool.workers == {}


def test_eligible_members_keep_pool_order() -> None:
    pool = members()
    a, b, c = (pool.add(f"http://127.0.0.1:900{i}") for i in range(3))
    for worker in (a, b, c):
        worker.health = Health.HEALTHY
    b.circuit = Circuit.OPEN
    assert pool.eligible() == [a, c]
    assert pool.eligible(exclude=a.url) == [c]
    assert pool.counts() == (2, 3)


async def test_a_drain_waits_for_requests_in_flight(nursery: trio.Nursery) -> None:
    pool = members()
    pool.nursery = nursery
    worker = pool.add(W1)
    worker.started("r1")
    removed: list[object] = []

    async def remove() -> None:
        removed.append(await pool.remove(W1))

    async with trio.open_nursery() as deletes:
        deletes.start_soon(remove)
        deletes.start_soon(remove)  # a second DELETE waits for the same drain
        await pool.wait_until(lambda: worker.draining)
        assert pool.eligible() == [] and pool.member(worker)
        worker.finished("r1")
    assert removed == [worker, worker] and not pool.member(worker)


async def test_without_the_pool_running_a_drain_runs_in_the_caller() -> None:
    pool = members()
    worker = pool.add(W1)
    assert not pool.start_soon(trio.sleep, 0)
    assert await pool.remove(W1) is worker
    assert pool.workers == {}
