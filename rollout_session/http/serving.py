"""Running an ASGI app on hypercorn's trio worker inside a caller's nursery.

One helper for the CLI, the demo, tests and benchmarks: bind (port 0 picks a
free port), start the app, listen, report the bound URL, and shut down
gracefully when asked.

`_serve` is hypercorn's trio ``worker_serve`` loop (plain HTTP; TLS ends at a
proxy), built from hypercorn's own lifespan, connection and worker-context
classes, with what that loop lacks:

- **the URL is reported once the server listens**: the socket is bound
  before the app starts (a port in use fails at once, as `CannotListen`),
  listens only once the app's start-up has completed, and only then is the
  URL reported. Hypercorn reported it, and listened, when the start-up had
  failed too (its ``wait_for_startup`` returns either way; `_Served` tells
  the two apart);
- **a connection cap**: at most ``max_connections`` connections are open;
  the next ones wait in the kernel's listen backlog until one closes. When
  the process runs out of file descriptors anyway (``accept`` failing with
  EMFILE), accepting waits for a connection to close instead of retrying
  every 100 ms with an error logged each time (trio's `serve_listeners`);
  either is logged at most once a minute;
- **a connection ends with its client**: hypercorn's waited for its idle
  timer after the client had closed (`_TCPServer`);
- **keep-alive after an answer**: hypercorn makes a connection idle (its
  keep-alive timeout, and the close at shutdown) in the task that sends the
  last body message, after it has told the app the exchange ended;
  Quart-Trio (and the session server's fast route) cancel that task as soon
  as they hear it, and the cancelled connection was never made idle: it
  stayed open until the client closed it, past the keep-alive timeout and
  past a shutdown, which then waited out its whole grace. So every app served
  here has its last body message sent shielded (`_Served`);
- **shutdown**: the listener closes, idle keep-alive connections close at
  once (hypercorn's ``terminated`` event), requests in flight get
  ``graceful_timeout``.

Hypercorn's internals. Its public API, ``hypercorn.trio.serve``, runs its
own accept loop with no hook for the listener or a connection, so neither
the cap nor a connection ending with its client can be had through it (nor
can an app: it never sees an idle connection). `_serve` therefore uses these,
none of them documented API; tests/unit/http/test_serving.py checks each
(names, signatures, and the behaviour they buy) and fails, naming it, on the
first hypercorn release that changes one (CI installs the newest; what they
buy is measured in docs/performance-history.md#serving-on-hypercorns-internals):

- ``hypercorn.trio.tcp_server.TCPServer``: serves one accepted connection
  (`_TCPServer` overrides its ``_read_data`` and stops its ``idle_task``);
- ``hypercorn.trio.lifespan.Lifespan``: the app's start-up and shutdown
  (``handle_lifespan``, ``wait_for_startup``, ``wait_for_shutdown``,
  ``supported``);
- ``hypercorn.trio.worker_context.WorkerContext``: its ``terminated`` event
  makes idle connections close;
- ``hypercorn.utils.wrap_app``, ``hypercorn.typing.ConnectionState`` and
  ``Config.create_sockets``: the app and the state as those classes take
  them, and the sockets for ``config.bind``.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import trio
from hypercorn.config import Config

# Hypercorn's internals, not its API: these three, `ConnectionState` and
# `wrap_app` (module doc; checked by tests/unit/http/test_serving.py).
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
    ConnectionState,
    Framework,
    LifespanState,
    Scope,
)
from hypercorn.utils import wrap_app

__all__ = ["CannotListen", "RunningServer", "hypercorn_config", "start_server"]

logger = logging.getLogger("rollout_session")

# Each condition is logged at most this often: a full server must not flood its log.
_WARN_EVERY_S = 60.0
# Out of descriptors, and no connection of ours closed: try accept again after this.
_FD_RETRY_S = 1.0
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class CannotListen(Exception):
    """The address could not be bound (in use, not local, not permitted)."""


def hypercorn_config(host: str, port: int, *, graceful_timeout_s: float = 5.0) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = graceful_timeout_s
    # Agents keep connections open between turns; a turn can last minutes.
    config.keep_alive_timeout = 75.0
    config.h11_max_incomplete_size = 64 * 1024
    return config


class _Connections:
    """The open connections, at most `cap` (mutated on the loop only).

    A listener reserves a slot before it accepts (`reserve`), then either
    fills it (`accepted`) or gives it back (`unreserve`); a connection's
    handler frees its slot when the connection ends (`closed`).
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open = 0  # accepted, not yet ended
        self._slots = 0  # open + reserved
        self._freed = trio.Event()  # set (and replaced) whenever a slot frees
        self._warned_at: dict[str, float] = {}

    async def reserve(self) -> None:
        while self._slots >= self.cap:
            self.warn(
                "full",
                f"connection cap reached ({self.open} open, --max-connections): "
                "new connections wait in the listen backlog until one closes",
            )
            await self._freed.wait()
        self._slots += 1

    def accepted(self) -> None:
        self.open += 1

    def unreserve(self) -> None:
        self._slots -= 1
        self._signal()

    def closed(self) -> None:
        self.open -= 1
        self._slots -= 1
        self._signal()

    def _signal(self) -> None:
        self._freed.set()
        self._freed = trio.Event()

    async def wait_for_a_close(self, timeout_s: float) -> None:
        with trio.move_on_after(timeout_s):
            await self._freed.wait()

    def warn(self, what: str, message: str) -> None:
        now = trio.current_time()
        if now - self._warned_at.get(what, -math.inf) >= _WARN_EVERY_S:
            self._warned_at[what] = now
            logger.warning(message)


class _CappedListener(trio.abc.Listener[trio.SocketStream]):
    """Accepts while a connection slot is free; the handler frees it."""

    def __init__(self, listener: trio.SocketListener, connections: _Connections) -> None:
        self._listener = listener
        self._connections = connections

    async def accept(self) -> trio.SocketStream:
        while True:
            await self._connections.reserve()
            try:
                stream = await self._listener.accept()
            except OSError as exc:
                self._connections.unreserve()
                if exc.errno not in _OUT_OF_FDS:
                    raise
                self._connections.warn(
                    "fds",
                    f"cannot accept a connection: {exc.strerror} "
                    f"({self._connections.open} open; lower --max-connections "
                    "or raise the file descriptor limit)",
                )
                await self._connections.wait_for_a_close(_FD_RETRY_S)
            except BaseException:
                self._connections.unreserve()
                raise
            else:
                self._connections.accepted()
                return stream

    async def aclose(self) -> None:
        await self._listener.aclose()


class _TCPServer(TCPServer):
    """Hypercorn's connection, ended when its client is gone: hypercorn's
    waited for its idle timer (up to the keep-alive timeout), holding the
    socket and a connection slot, after the client had closed."""

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


class _Served:
    """`app` (ASGI 3, as every app served here) as it is served: each
    response's last body message sent shielded (module doc), and whether its
    start-up completed noted (hypercorn's `Lifespan` returns from
    ``wait_for_startup`` when it failed too)."""

    def __init__(self, app: Framework) -> None:
        self._app = cast(ASGIFramework, app)
        self.started_up = False

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http":
            await self._app(scope, receive, partial(_send_last_shielded, send))
        elif scope["type"] == "lifespan":
            await self._app(scope, receive, partial(self._send_lifespan, send))
        else:
            await self._app(scope, receive, send)

    async def _send_lifespan(self, send: ASGISendCallable, message: ASGISendEvent) -> None:
        if message["type"] == "lifespan.startup.complete":
            self.started_up = True
        await send(message)


async def _send_last_shielded(send: ASGISendCallable, message: ASGISendEvent) -> None:
    if message["type"] == "http.response.body" and not message.get("more_body", False):
        with trio.CancelScope(shield=True):
            await send(message)
    else:
        await send(message)


def _url(sock: socket.socket) -> str:
    """The URL a listening socket serves (``repr_socket_addr``'s form)."""
    address = sock.getsockname()
    if sock.family == socket.AF_INET:
        return f"http://{address[0]}:{address[1]}"
    if sock.family == socket.AF_INET6:
        return f"http://[{address[0]}]:{address[1]}"
    if sock.family == socket.AF_UNIX:
        return f"http://unix:{address}"
    return f"http://{address}"


async def _serve(
    app: Framework,
    config: Config,
    connections: _Connections,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    task_status: trio.TaskStatus[list[str]],
) -> None:
    served = _Served(app)
    wrapped = wrap_app(served, config.wsgi_max_body_size, "asgi")
    state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, state)
    context = WorkerContext(None)
    try:
        sockets = config.create_sockets()
    except OSError as exc:
        raise CannotListen(f"cannot listen on {', '.join(config.bind)}: {exc}") from exc
    if sockets.secure_sockets or sockets.quic_sockets:
        raise ValueError("TLS is not served here: terminate it at a proxy")

    async def handle(stream: trio.SocketStream) -> None:
        try:
            # The state is the connection's own copy: TCPServer (0.18) does not copy it.
            await _TCPServer(wrapped, config, context, ConnectionState(state.copy()), stream)  # type: ignore[arg-type]
        finally:
            connections.closed()

    try:
        async with trio.open_nursery() as lifespan_nursery:
            await lifespan_nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            if lifespan.supported and not served.started_up:
                # The app's start-up failed: the error is on its way out of
                # the lifespan task and cancels this one. Never listen.
                await trio.sleep_forever()
            listeners, binds = [], []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                listeners.append(_CappedListener(listener, connections))
                binds.append(_url(sock))
            async with trio.open_nursery() as server_nursery:
                task_status.started(binds)
                try:
                    async with trio.open_nursery() as accepting:
                        accepting.start_soon(
                            partial(
                                trio.serve_listeners,
                                handle,
                                listeners,
                                handler_nursery=server_nursery,
                            )
                        )
                        await shutdown_trigger()
                        accepting.cancel_scope.cancel()  # closes the listeners
                finally:
                    # Idle connections close now; busy ones after their answer.
                    await context.terminated.set()
                    server_nursery.cancel_scope.deadline = (
                        trio.current_time() + config.graceful_timeout
                    )
            await lifespan.wait_for_shutdown()
            lifespan_nursery.cancel_scope.cancel()
    finally:
        for sock in sockets.insecure_sockets:
            sock.close()  # a no-op once its listener closed it


@dataclass
class RunningServer:
    """A server started by `start_server`; `url` has no trailing slash."""

    url: str
    _stop: trio.Event
    _stopped: trio.Event
    _connections: _Connections

    @property
    def open_connections(self) -> int:
        """Client connections accepted and not yet closed."""
        return self._connections.open

    def stop(self) -> None:
        """Trigger a graceful shutdown (returns at once)."""
        self._stop.set()

    async def aclose(self) -> None:
        """Shut down and wait until the server has stopped."""
        self._stop.set()
        await self._stopped.wait()


async def start_server(
    nursery: trio.Nursery,
    app: Framework,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_connections: int = 4096,
    **config_overrides: Any,
) -> RunningServer:
    """Start `app` in `nursery`; return once it has started and is listening."""
    config = hypercorn_config(host, port)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    stop, stopped = trio.Event(), trio.Event()
    connections = _Connections(max_connections)

    async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await _serve(
                app, config, connections, shutdown_trigger=stop.wait, task_status=task_status
            )
        finally:
            stopped.set()

    binds: list[str] = await nursery.start(run)
    return RunningServer(url=binds[0], _stop=stop, _stopped=stopped, _connections=connections)
