"""`WorkerClient` against a bare HTTP/1.1 server that shows its connections:
reuse, bounds, and what happens to connections that cannot be reused."""

from __future__ import annotations

import functools

import httpcore
import pytest
import trio
from httpcore._backends.trio import TrioStream  # what WorkerClient's reads reach

from rollout_session.engines.pool.client import (
    READ_BYTES,
    NotSent,
    UpstreamReply,
    WorkerClient,
    post,
)
from rollout_session.engines.sglang_workers import fetch_model_info
from rollout_session.errors import UpstreamError
from tests.unit.engines.pool.origin import ANSWER, LARGE, Origin

ANY_SIZE = 1 << 30  # no answer here comes near --max-answer-mb


async def _post(client: WorkerClient, session_id: str) -> UpstreamReply:
    """A turn's POST of an empty JSON body, as the pool sends one."""
    return await post(
        client,
        "/v1/chat/completions",
        b"{}",
        session_id=session_id,
        session_headers=(b"x-smg-routing-key",),
        timeout_s=10.0,
        max_bytes=ANY_SIZE,
    )


def client_for(origin: Origin, max_connections: int = 4) -> WorkerClient:
    return WorkerClient(
        origin.url, max_connections=max_connections, timeout_s=10.0, connect_timeout_s=5.0
    )


async def test_sequential_requests_share_one_connection(origin: Origin) -> None:
    client = client_for(origin)
    for i in range(5):
        reply = await _post(client, f"s{i}")
        assert (reply.status, reply.body) == (200, ANSWER)
        assert reply.headers == [(b"content-type", b"application/json")]
    assert origin.connections == 1
    assert {number for number, _, _ in origin.requests} == {1}
    _, target, headers = origin.requests[0]
    assert target == b"/v1/chat/completions"
    assert headers[b"x-smg-routing-key"] == b"s0"
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"accept-encoding"] == b"identity"
    await client.aclose()
    await origin.wait_for(lambda: origin.open_now == 0)


async def test_large_answers_are_read_in_large_reads(
    origin: Origin, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []
    trio_read = TrioStream.read

    async def read(self: TrioStream, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        asked.append(max_bytes)
        return await trio_read(self, max_bytes, timeout)

    monkeypatch.setattr(TrioStream, "read", read)
    client = client_for(origin)
    per_request = []
    for target in ("/ok", "/ok", "/large", "/ok", "/large"):
        asked.clear()
        response = await client.request(b"POST", target, [], b"{}", max_bytes=ANY_SIZE)
        assert response.body == (LARGE if target == "/large" else ANSWER)
        per_request.append(list(asked))
    # Small answers: httpcore's 64 KiB reads (no 1 MiB buffer for 12 bytes).
    assert per_request[0] == per_request[1] == [64 * 1024]
    # 3 MiB: after a full read, up to 1 MiB at a time (not 48 reads).
    for reads in per_request[2], per_request[4]:
        assert READ_BYTES in reads and len(reads) < 3 * 16
    assert origin.connections == 1  # nothing left over on the connection
    await client.aclose()


async def test_concurrent_requests_are_bounded_by_max_connections(origin: Origin) -> None:
    client = client_for(origin, max_connections=2)
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(
                functools.partial(client.request, max_bytes=ANY_SIZE), b"POST", "/hold", [], b"{}"
            )
        await origin.wait_for(lambda: len(origin.requests) == 2)
        origin.release.set()
    assert len(origin.requests) == 5
    assert origin.most_open == 2
    await client.aclose()


async def test_cancelled_exchange_closes_its_connection(origin: Origin) -> None:
    client = client_for(origin)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(client.request, max_bytes=ANY_SIZE), b"POST", "/hold", [], b"{}"
            )
            await origin.wait_for(lambda: len(origin.requests) == 1)
            scope.cancel()
    # The worker sees the disconnect (SGLang aborts the request on it) ...
    await origin.wait_for(lambda: origin.open_now == 0)
    # ... and the next exchange gets a fresh connection.
    reply = await _post(client, "s")
    assert reply.status == 200
    assert origin.connections == 2
    await client.aclose()


async def test_connection_closed_by_the_worker_is_not_reused(origin: Origin) -> None:
    client = client_for(origin)
    response = await client.request(b"POST", "/close", [], b"{}", max_bytes=ANY_SIZE)
    assert response.status == 200
    await origin.wait_for(lambda: origin.open_now == 0)
    # Had the idle connection been reused, this would fail with "server
    # disconnected" (a 502 for the agent); instead a new one is opened.
    reply = await _post(client, "s")
    assert reply.status == 200
    assert origin.connections == 2
    await client.aclose()


async def test_refused_connection_is_not_sent_and_a_closed_client_sends_nothing(
    origin: Origin,
) -> None:
    # Timeouts and transport errors are covered end to end (test_failures.py).
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = f"http://127.0.0.1:{port}"  # bound, never listening: refused
    client = WorkerClient(dead, max_connections=2, timeout_s=10.0, connect_timeout_s=5.0)
    with pytest.raises(NotSent):
        await _post(client, "s")
    with pytest.raises(UpstreamError, match="cannot read model info"):
        await fetch_model_info(client, 5.0)
    closed = client_for(origin)
    await closed.aclose()
    with pytest.raises(httpcore.ConnectError):
        await closed.request(b"GET", "/", [], max_bytes=ANY_SIZE)
    assert origin.connections == 0


async def test_model_info_has_a_deadline_against_a_silent_worker(nursery: trio.Nursery) -> None:
    """A worker that accepts and never answers does not hold start-up."""
    accepted = trio.Event()

    async def silent(stream: trio.SocketStream) -> None:
        accepted.set()
        await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    client = WorkerClient(
        f"http://127.0.0.1:{port}", max_connections=2, timeout_s=600.0, connect_timeout_s=5.0
    )
    with trio.fail_after(30), pytest.raises(UpstreamError, match=r"no answer within 0\.2 s"):
        await fetch_model_info(client, 0.2)
    assert accepted.is_set()
    await client.aclose()
