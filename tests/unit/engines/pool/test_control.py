"""Best-effort calls: worker-side sessions closed in the background, and
failures counted every time, logged once per worker and call."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest
import trio

from rollout_session.engines.pool.control import Control
from rollout_session.engines.pool.membership import Membership
from tests.unit.engines.pool.parts import Session, options

W1 = "http://127.0.0.1:9001"


class Recorder:
    """A worker's /close_session; `changed` is set on each call."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.closed: list[tuple[str, str]] = []
        self.changed = trio.Event()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        self.closed.append((f"{request.url.host}:{request.url.port}", body["session_id"]))
        self.changed.set()
        self.changed = trio.Event()
        return httpx.Response(self.status)

    async def wait_for(self, calls: int) -> None:
        while len(self.closed) < calls:
            await self.changed.wait()


def control(recorder: Recorder, *, hints: bool, nursery: trio.Nursery | None) -> Control:
    members = Membership(options(), httpx.create_ssl_context(trust_env=False))
    members.nursery = nursery
    members.add(W1)
    client = httpx.AsyncClient(transport=httpx.MockTransport(recorder))
    return Control(members, client, session_hints=hints, timeout_s=2.0)


async def test_a_sessions_kv_is_released_only_with_hints(nursery: trio.Nursery) -> None:
    recorder = Recorder()
    without = control(recorder, hints=False, nursery=nursery)
    without.close_remote(W1, "s1")
    with_hints = control(recorder, hints=True, nursery=nursery)
    with_hints.close_remote(W1, "s2")
    with_hints.close_worker_session(W1, "remote-3")  # delta-sync's: always closed
    await recorder.wait_for(2)
    assert sorted(recorder.closed) == [("127.0.0.1:9001", "remote-3"), ("127.0.0.1:9001", "s2")]


async def test_failures_are_counted_every_time_and_logged_once(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder(status=404)  # a gateway without the route
    calls = control(recorder, hints=True, nursery=nursery)
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        for i in range(3):
            calls.close_remote(W1, f"s{i}")
        await recorder.wait_for(3)
        # Each failure is counted once its answer is read (`count` notifies).
        await calls._members.wait_until(lambda: calls.failures["POST /close_session"] == 3)
    assert calls._members.get(W1).control_failures["POST /close_session"] == 3
    assert caplog.text.count("POST /close_session failed (answered 404)") == 1


async def test_shutdown_closes_every_pinned_session_at_once() -> None:
    recorder = Recorder()
    calls = control(recorder, hints=True, nursery=None)
    await calls.close_remote_sessions([Session("a", W1), Session("b", None), Session("c", W1)])
    assert sorted(s for _, s in recorder.closed) == ["a", "c"]  # "b" was never pinned
