"""Waiting out a worker its trainer paused (`paused.Pauses`), against a bare
worker (`origin.Origin`) whose ``/is_paused`` the test sets: one watcher
however many requests wait, the wait ends when the worker resumes, past its
deadline it is a 503 ``server_paused``, and a worker that cannot say lets
the requests go again."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
import trio

from rollout_session.engines.pool.membership import Membership
from rollout_session.engines.pool.paused import Pauses
from rollout_session.engines.pool.worker import Worker
from rollout_session.errors import ServerPaused
from tests.unit.engines.pool.origin import Origin, paths
from tests.unit.engines.pool.parts import DIALECT, options

DIALECT_WITH_PAUSE = dataclasses.replace(
    DIALECT,
    paused=lambda reply: reply.status == 503,
    pause_status=("/is_paused", lambda answer: answer.get("is_paused")),
)


def set_paused(origin: Origin, paused: bool) -> None:
    origin.routes[b"/is_paused"] = (200, orjson.dumps({"is_paused": paused}))


@pytest.fixture
async def pauses(origin: Origin, nursery: trio.Nursery) -> AsyncIterator[tuple[Pauses, Worker]]:
    opts = options(dialect=DIALECT_WITH_PAUSE, worker_pause_wait_s=30.0)
    members = Membership(opts, httpx.create_ssl_context(trust_env=False))
    members.nursery = nursery
    worker = members.add(origin.url)
    yield Pauses(members, opts), worker
    await members.aclose()


async def test_waiters_share_one_watcher_and_go_when_the_worker_resumes(
    origin: Origin, pauses: tuple[Pauses, Worker]
) -> None:
    waiting, worker = pauses
    set_paused(origin, True)
    done: list[int] = []

    async def wait(i: int) -> None:
        await waiting.wait(worker, trio.current_time() + 30)
        done.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(wait, i)
        await origin.wait_for(lambda: paths(origin).count(b"/is_paused") >= 2)
        assert done == []
        set_paused(origin, False)
    assert sorted(done) == [0, 1, 2, 3, 4]
    assert worker.paused_refusals == 5
    # One watcher read the status for all five: reads were one at a time.
    reads = paths(origin).count(b"/is_paused")
    assert 2 <= reads <= 6


async def test_a_pause_past_the_deadline_is_server_paused(
    origin: Origin, pauses: tuple[Pauses, Worker]
) -> None:
    waiting, worker = pauses
    set_paused(origin, True)
    with pytest.raises(ServerPaused, match="did not resume within 30 s") as refused:
        await waiting.wait(worker, trio.current_time() + 0.2)
    assert refused.value.status_code == 503 and refused.value.code == "server_paused"


async def test_a_worker_that_cannot_say_lets_the_request_go_again(
    origin: Origin, pauses: tuple[Pauses, Worker]
) -> None:
    """Without VLLM_SERVER_DEV_MODE there is no /is_paused: the request is
    sent again, each time after a longer wait."""
    waiting, worker = pauses
    origin.routes[b"/is_paused"] = (404, b'{"detail": "Not Found"}')
    started = trio.current_time()
    await waiting.wait(worker, started + 30)
    first = trio.current_time() - started
    await waiting.wait(worker, started + 30)
    second = trio.current_time() - started - first
    assert second > first  # the wait grows while nothing gets through
    waiting.ended(worker)  # a request got through: the next pause starts short
    started = trio.current_time()
    await waiting.wait(worker, started + 30)
    assert trio.current_time() - started < second
