"""The hypercorn internals `serving` relies on, checked against the installed
hypercorn (its module doc says why: hypercorn's public API has no hook for
the connection cap, nor for ending a connection when its client closes).

Each check names the internal and what `serving` does with it, so the first
hypercorn release that renames, re-signs or drops one fails here, saying
which; the last tests check, on a plain ASGI app, the behaviour those
internals buy (tests/integration/http/test_serving.py checks it on the
session server)."""

from __future__ import annotations

import ast
import inspect
import socket
from collections.abc import Callable
from importlib import import_module
from importlib.metadata import version
from typing import Any, NoReturn

import pytest
import trio
import trio.testing
from hypercorn.config import Config

from rollout_session.http import serving
from rollout_session.http.serving import start_server

HYPERCORN = version("hypercorn")
STALL_S = 10.0
LONG_S = 3600.0  # far above STALL_S: waiting it out fails the test

# Each internal: its parameters (None: not called), whether it is a coroutine
# function, and what `serving` does with it.
INTERNALS: dict[str, tuple[tuple[str, ...] | None, bool, str]] = {
    "hypercorn.trio.tcp_server.TCPServer": (
        ("app", "config", "context", "state", "stream"),
        False,
        "`_TCPServer(...)` is awaited to serve each accepted connection",
    ),
    "hypercorn.trio.tcp_server.TCPServer._read_data": (
        ("self",),
        True,
        "`_TCPServer` overrides it to stop the idle timer once the client has closed",
    ),
    "hypercorn.trio.lifespan.Lifespan": (
        ("app", "config", "state"),
        False,
        "runs the app's start-up and shutdown",
    ),
    "hypercorn.trio.lifespan.Lifespan.handle_lifespan": (
        ("self", "task_status"),
        True,
        "started in the lifespan nursery",
    ),
    "hypercorn.trio.lifespan.Lifespan.wait_for_startup": (
        ("self",),
        True,
        "awaited before the socket listens",
    ),
    "hypercorn.trio.lifespan.Lifespan.wait_for_shutdown": (
        ("self",),
        True,
        "awaited after the connections have ended",
    ),
    "hypercorn.trio.worker_context.WorkerContext": (
        ("max_requests",),
        False,
        "shared by the connections; its `terminated` event closes idle ones",
    ),
    "hypercorn.utils.wrap_app": (
        ("app", "wsgi_max_body_size", "mode"),
        False,
        "gives the app the calling convention TCPServer and Lifespan expect",
    ),
    "hypercorn.typing.ConnectionState": (
        None,
        False,
        "wraps each connection's copy of the lifespan state for TCPServer",
    ),
    "hypercorn.config.Config.create_sockets": (
        ("self",),
        False,
        "binds `config.bind` (`fd://` included) before the app starts",
    ),
    "hypercorn.utils.LifespanFailureError": (
        None,
        False,
        "what a failed start-up raises; the CLI reports it as `cannot start`",
    ),
}

# What `serving` may import from hypercorn without a check here: its API.
PUBLIC = {"hypercorn.config.Config", "hypercorn.trio.serve"}
PUBLIC_MODULES = {"hypercorn.typing"}  # type annotations, ConnectionState aside


def resolve(dotted: str) -> Any:
    """The object at `dotted` (a module's attribute, or an attribute's)."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        else:
            return obj
        break
    fail(dotted, "is gone")


def fail(dotted: str, problem: str) -> NoReturn:
    pytest.fail(
        f"hypercorn {HYPERCORN}: {dotted} {problem}; serving.py relies on it: "
        f"{INTERNALS[dotted][2]}. Rework serving.py before allowing this hypercorn."
    )


def test_serving_imports_from_hypercorn_only_its_api_and_the_internals_checked_here() -> None:
    tree = ast.parse(inspect.getsource(serving))
    imported = {
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hypercorn")
        for alias in node.names
        if node.module not in PUBLIC_MODULES or alias.name == "ConnectionState"
    }
    unchecked = imported - PUBLIC - INTERNALS.keys()
    assert not unchecked, (
        f"serving.py imports {sorted(unchecked)} from hypercorn: not its API and not "
        "checked in INTERNALS here; add each, with what serving.py does with it"
    )


@pytest.mark.parametrize("dotted", list(INTERNALS))
def test_the_internal_is_there_with_the_signature_relied_on(dotted: str) -> None:
    obj = resolve(dotted)
    parameters, is_coroutine, _ = INTERNALS[dotted]
    if parameters is not None:
        actual = tuple(inspect.signature(obj).parameters)
        if actual != parameters:
            fail(dotted, f"takes {actual}, not {parameters}")
    if is_coroutine and not inspect.iscoroutinefunction(obj):
        fail(dotted, "is no longer a coroutine function")


async def test_the_instances_have_the_attributes_relied_on() -> None:
    from hypercorn.trio.lifespan import Lifespan
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.utils import wrap_app

    config = Config()
    context = WorkerContext(None)
    checks: list[tuple[str, str, Callable[[], object]]] = [
        (
            "hypercorn.trio.lifespan.Lifespan",
            "`supported` (False when the app has no lifespan)",
            lambda: Lifespan(wrap_app(_app, 0, "asgi"), config, {}).supported is True,
        ),
        (
            "hypercorn.trio.worker_context.WorkerContext",
            "`terminated.set()` (a coroutine function)",
            lambda: inspect.iscoroutinefunction(context.terminated.set),
        ),
        (
            "hypercorn.trio.tcp_server.TCPServer",
            "`idle_task.stop()` (a coroutine function) and `__await__`",
            lambda: (
                inspect.iscoroutinefunction(
                    TCPServer(_app, config, context, {}, None).idle_task.stop  # type: ignore[arg-type]
                )
                and hasattr(TCPServer, "__await__")
            ),
        ),
    ]
    for dotted, what, check in checks:
        try:
            ok = check()
        except (AttributeError, TypeError) as exc:
            fail(dotted, f"has no {what} ({exc!r})")
        if not ok:
            fail(dotted, f"has no {what}")


def test_create_sockets_takes_a_bound_socket_by_fd() -> None:
    config = Config()
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        config.bind = [f"fd://{bound.fileno()}"]
        sockets = config.create_sockets()
        try:
            fds = [sock.fileno() for sock in sockets.insecure_sockets]
            if fds != [bound.fileno()] or sockets.secure_sockets or sockets.quic_sockets:
                fail(
                    "hypercorn.config.Config.create_sockets",
                    f"made {sockets} of an fd:// bind, not one insecure socket on that fd",
                )
        finally:
            for sock in sockets.insecure_sockets:
                sock.detach()  # `bound` closes the descriptor


# The behaviour bought, on a plain ASGI app.


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    while (await receive()).get("more_body"):
        pass
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


async def _idle_connection(url: str) -> trio.SocketStream:
    """A keep-alive connection after one answer, idle on the server's side."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    received = b""
    while not received.endswith(b"\r\n\r\nok"):
        received += await stream.receive_some()
    await trio.testing.wait_all_tasks_blocked()
    return stream


async def test_a_connection_ends_when_its_client_closes(nursery: trio.Nursery) -> None:
    """Without `_TCPServer`, hypercorn's connection waits out its keep-alive
    timeout after the client has gone, holding its socket and a slot."""
    server = await start_server(nursery, _app, keep_alive_timeout=LONG_S)
    stream = await _idle_connection(server.url)
    assert server.open_connections == 1
    await stream.aclose()
    await trio.testing.wait_all_tasks_blocked()  # the server's side winds down
    assert server.open_connections == 0
    await server.aclose()


async def test_an_idle_connection_closes_at_shutdown(nursery: trio.Nursery) -> None:
    """WorkerContext's `terminated` event, set at shutdown, closes it."""
    server = await start_server(nursery, _app, graceful_timeout=LONG_S)
    stream = await _idle_connection(server.url)
    with trio.fail_after(STALL_S):
        await server.aclose()
        assert await stream.receive_some() == b""
    await stream.aclose()


async def test_a_failed_start_up_raises_and_never_listens() -> None:
    """The socket, bound by fd (`create_sockets`), does not listen while the
    app starts, and a failed start-up raises hypercorn's `LifespanFailureError`
    instead of reporting a URL."""
    from hypercorn.utils import LifespanFailureError

    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    port = bound.getsockname()[1]
    listening: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        assert (await receive())["type"] == "lifespan.startup"
        try:
            await (await trio.open_tcp_stream("127.0.0.1", port)).aclose()
        except OSError:
            listening.append(False)
        else:
            listening.append(True)
        await send({"type": "lifespan.startup.failed", "message": "no"})

    urls: list[str] = []
    with trio.fail_after(STALL_S), pytest.raises(BaseExceptionGroup) as raised:
        async with trio.open_nursery() as nursery:
            server = await start_server(nursery, app, bind=[f"fd://{bound.detach()}"])
            urls.append(server.url)
    assert raised.group_contains(LifespanFailureError)
    assert urls == []
    assert listening == [False]
