"""The server's listener and its life: a connection cap, idle keep-alive
connections that close (after the keep-alive timeout, and at once at
shutdown, so SIGTERM does not wait out its grace), and "listening" printed
only once the server listens."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from quart_trio import QuartTrio

from rollout_session import Settings, create_app
from rollout_session.http.serving import RunningServer, start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests import FIXTURES
from tests.conftest import Stack, StackFactory
from tests.integration.raw_http import RawConnection
from tests.loopback import TLS
from tests.processes import start_listening

STALL_S = 10.0
# Far above STALL_S: a server that waits out its grace fails the test.
LONG_GRACE_S = 3600.0
CHAT_BODY = b'{"messages": [{"role": "user", "content": "hi"}]}'
BROKEN = FIXTURES / "broken-templates" / "drops-history.jinja"

ServerFactory = Callable[..., Awaitable[RunningServer]]


@pytest.fixture
async def serve_on(
    nursery: trio.Nursery, stack: Stack, chat_tokenizers: dict[str, ChatTokenizer]
) -> AsyncIterator[ServerFactory]:
    """A server on the stack's worker with hypercorn settings of the test's."""
    servers: list[RunningServer] = []

    async def factory(**config: Any) -> RunningServer:
        app = create_app(
            Settings(workers=(stack.emulator_url,), port=0),
            tokenizer=chat_tokenizers["chatml"],
            worker_tls=TLS,
        )
        servers.append(await start_server(nursery, app, **config))
        return servers[-1]

    yield factory
    for server in servers:
        await server.aclose()


async def idle_connections(url: str) -> list[RawConnection]:
    """Two keep-alive connections, idle after an answer: one from a Quart
    route, one from the chat route (served by the edge)."""
    quart, chat = await RawConnection.open(url), await RawConnection.open(url)
    with trio.fail_after(STALL_S):
        assert (await quart.request("GET", "/health")).status == 200
        created = await chat.request("POST", "/sessions", body=b"{}")
        session_id = created.body.split(b'"session_id":"')[1].split(b'"')[0].decode()
        turn = await chat.request(
            "POST", f"/sessions/{session_id}/v1/chat/completions", body=CHAT_BODY
        )
        assert turn.status == 200, turn.body
    assert not quart.has_unread_bytes() and not chat.has_unread_bytes()
    return [quart, chat]


async def test_shutdown_closes_idle_keep_alive_connections_at_once(
    serve_on: ServerFactory,
) -> None:
    server = await serve_on(graceful_timeout=LONG_GRACE_S)
    connections = await idle_connections(server.url)
    with trio.fail_after(STALL_S):
        await server.aclose()
        for conn in connections:
            assert await conn.closed_by_server()
    for conn in connections:
        await conn.aclose()


async def test_a_plain_quart_app_closes_idle_keep_alive_connections_at_shutdown(
    nursery: trio.Nursery,
) -> None:
    """Every app `start_server` serves (the emulator, tests' fake workers), not
    only the session server: a shutdown never waits out the grace for an
    idle connection."""
    app = QuartTrio("plain")

    @app.get("/ping")
    async def ping() -> str:
        return "pong"

    server = await start_server(nursery, app, graceful_timeout=LONG_GRACE_S)
    conn = await RawConnection.open(server.url)
    with trio.fail_after(STALL_S):
        assert (await conn.request("GET", "/ping")).status == 200
        await server.aclose()
        assert await conn.closed_by_server()
    await conn.aclose()


async def test_idle_keep_alive_connections_close_after_the_keep_alive_timeout(
    serve_on: ServerFactory,
) -> None:
    server = await serve_on(keep_alive_timeout=0.2)
    connections = await idle_connections(server.url)
    with trio.fail_after(STALL_S):
        for conn in connections:
            assert await conn.closed_by_server()
    await trio.testing.wait_all_tasks_blocked()  # the server's side winds down
    assert server.open_connections == 0
    for conn in connections:
        await conn.aclose()


async def test_connections_over_the_cap_wait_for_one_to_close(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await make_stack(max_connections=2)
    first, second = await RawConnection.open(stack.url), await RawConnection.open(stack.url)
    with trio.fail_after(STALL_S):
        for conn in (first, second):
            assert (await conn.request("GET", "/health")).status == 200
    assert stack.server.open_connections == 2
    third = await RawConnection.open(stack.url)  # the kernel's backlog takes it
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        await third.send_head("GET", "/health", {"content-length": "0"})
        await trio.testing.wait_all_tasks_blocked()
        assert stack.server.open_connections == 2
        assert not third.has_unread_bytes()
    assert any("connection cap reached (2 open" in r.getMessage() for r in caplog.records)
    await first.aclose()
    with trio.fail_after(STALL_S):
        assert (await third.response()).status == 200
        assert (await second.request("GET", "/health")).status == 200
    for conn in (second, third):
        await conn.aclose()


def serve_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "rollout_session", "serve", "--demo", *flags]


ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


async def test_sigterm_with_idle_keep_alive_connections_exits_promptly() -> None:
    command = serve_command("--port", "0", "--shutdown-grace-s", str(LONG_GRACE_S))
    async with trio.open_nursery() as nursery:
        url, process = await start_listening(nursery, command, env=ENV)
        connections = await idle_connections(url)
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(STALL_S * 3):
            for conn in connections:
                assert await conn.closed_by_server()
            assert await process.wait() == 0
        for conn in connections:
            await conn.aclose()


async def test_listening_is_not_printed_when_the_app_cannot_start() -> None:
    command = serve_command("--port", "0", "--chat-template", str(BROKEN))
    with trio.fail_after(60):
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False, env=ENV
        )
    assert done.returncode == 1
    assert b"cannot start: the chat template cannot be extended" in done.stderr
    assert b"listening" not in done.stdout, done.stdout.decode()


async def test_a_port_in_use_is_named_and_listening_is_not_printed() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(60):
            done = await trio.run_process(
                serve_command("--port", str(port)),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=ENV,
            )
    assert done.returncode == 1
    assert f"cannot start: cannot listen on 127.0.0.1:{port}:".encode() in done.stderr
    assert b"Traceback" not in done.stderr
    assert b"listening" not in done.stdout, done.stdout.decode()
