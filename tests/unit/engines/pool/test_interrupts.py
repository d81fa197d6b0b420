"""A pause in abort mode: new requests held until resumed, and each worker
asked to abort the requests it has, by the dialect's route."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest
import trio

from rollout_session.engines.pool.control import Control
from rollout_session.engines.pool.interrupts import Interrupts
from rollout_session.engines.pool.membership import Membership
from tests.unit.engines.pool.parts import options


def interrupts(handler: httpx.MockTransport) -> tuple[Membership, Interrupts, Control]:
    opts = options()
    members = Membership(opts, httpx.create_ssl_context(trust_env=False))
    client = httpx.AsyncClient(transport=handler)
    control = Control(members, client, session_hints=False, timeout_s=2.0)
    return members, Interrupts(members, opts, client, control), control


async def test_each_worker_is_asked_to_abort_its_requests_and_sending_waits() -> None:
    asked: list[tuple[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append((f"{request.url.port}{request.url.path}", orjson.loads(request.content)))
        return httpx.Response(200)

    members, pause, _ = interrupts(httpx.MockTransport(handler))
    busy, idle = members.add("http://127.0.0.1:9001"), members.add("http://127.0.0.1:9002")
    busy.started("r2")
    busy.started("r1")
    busy.started(None)  # not abortable
    assert idle.requests == set()
    assert await pause.interrupt() == 2
    assert asked == [("9001/abort", {"ids": ["r1", "r2"]})]
    sent = trio.Event()

    async def send() -> None:
        await pause.wait_to_send()
        sent.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        await trio.testing.wait_all_tasks_blocked()
        assert not sent.is_set()  # held while interrupted
        pause.resume_sending()
    assert sent.is_set()


async def test_a_worker_that_cannot_abort_is_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    members, pause, control = interrupts(httpx.MockTransport(lambda _: httpx.Response(503)))
    worker = members.add("http://127.0.0.1:9001")
    worker.started("r1")
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        assert await pause.interrupt() == 1
    assert control.failures["/abort"] == 1 and worker.control_failures["/abort"] == 1
    assert "its turns in flight were not interrupted" in caplog.text
