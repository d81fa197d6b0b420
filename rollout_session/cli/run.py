"""Running one session server: `serve` (until SIGINT/SIGTERM), `run_server`
(until told), the connection cap within the descriptor limit, and why a
start failed, said in one line instead of a traceback.

Imports nothing of `rollout_session.emulator`: demo workers come in as
`run_server`'s `start_workers` (`cli.demo.start_demo_workers`), from the
callers that support ``--demo``.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import trio

from ..config import Settings

__all__ = [
    "JournalStartFailed",
    "StartWorkers",
    "connection_cap",
    "run_or_explain",
    "run_server",
    "serve",
    "setup_logging",
]

# Starts workers in the nursery; returns the settings that name them.
StartWorkers: TypeAlias = Callable[[trio.Nursery, Settings], Awaitable[Settings]]
_T = TypeVar("_T")


class JournalStartFailed(Exception):
    """The journal could not be opened before listening (a start-up failure)."""


def setup_logging(level: str) -> None:
    """Log lines to stderr at `level` (``--log-level``)."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # httpx logs every request at INFO: health probes alone would flood the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))


async def serve(
    settings: Settings,
    *,
    listen_fd: int | None = None,
    start_workers: StartWorkers | None = None,
) -> None:
    """Run the server (and, in demo mode, its workers from `start_workers`)
    until SIGINT/SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

        async def until_signal() -> None:
            async for _ in signals:
                break

        await run_server(settings, until_signal, listen_fd=listen_fd, start_workers=start_workers)


async def run_server(
    settings: Settings,
    until: Callable[[], Awaitable[object]],
    *,
    listen_fd: int | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    start_workers: StartWorkers | None = None,
) -> None:
    """Run the server until `until()` returns, then stop it gracefully. On
    `listen_fd`, a bound socket, instead of binding host and port; the URL
    goes to `task_status` once the server listens. With ``settings.demo``,
    `start_workers` (`cli.demo.start_demo_workers`) starts the workers first."""
    from ..http.app import create_app, server_context
    from ..http.serving import start_server

    if settings.demo and start_workers is None:
        raise ValueError("demo settings need start_workers (cli.demo.start_demo_workers)")
    async with trio.open_nursery() as nursery:
        if settings.demo and start_workers is not None:
            settings = await start_workers(nursery, settings)
        app = create_app(settings)
        # Replay before the listener opens: the app's own start-up has
        # hypercorn's fixed limit, replay none (it takes what the journal takes).
        store = server_context(app).store
        try:
            await store.open_journal(settings.journal_options())
        except OSError as exc:
            raise JournalStartFailed(f"journal {settings.journal}: {exc}") from exc
        bind = {} if listen_fd is None else {"bind": [f"fd://{listen_fd}"]}
        try:
            # Returns once the app has started and the socket listens (a
            # failed start raises instead: nothing below is printed).
            server = await start_server(
                nursery,
                app,
                host=settings.host,
                port=settings.port,
                max_connections=_connection_cap(settings),
                graceful_timeout=settings.shutdown_grace_s,
                **bind,
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await store.aclose()
            raise
        # Startup is done: what is loaded now (tokenizer, templates, modules)
        # lives as long as the process; keep it out of every later GC pass
        # (docs/performance.md#gc-freeze-after-start-up).
        gc.freeze()
        auth = ' -H "Authorization: Bearer $KEY"' if settings.api_key else ""
        print(f"rollout-session listening on {server.url}", flush=True)
        print(f"  create a session: curl -X POST{auth} {server.url}/sessions", flush=True)
        print(f"  inspector: {server.url}/ui", flush=True)
        task_status.started(server.url)
        await until()
        await server.aclose()
        nursery.cancel_scope.cancel()


# Descriptors the server needs besides client and worker connections: the
# event loop's, the journal's, validation processes' pipes, tokenizer files.
_FD_RESERVE = 128


def connection_cap(max_connections: int, reserve: int, fd_limit: int) -> int:
    """`max_connections`, or fewer if the process could not hold them and
    `reserve` more descriptors (`fd_limit` < 0: unlimited)."""
    if fd_limit < 0 or max_connections + reserve <= fd_limit:
        return max_connections
    return max(1, fd_limit - reserve)


def _connection_cap(settings: Settings) -> int:
    """--max-connections within the descriptors this process may open, after
    raising its soft limit toward the hard one as far as it needs (as vLLM's
    and SGLang's servers raise theirs); a lower cap is logged."""
    import resource

    reserve = _FD_RESERVE + settings.upstream_max_connections * max(1, len(settings.workers))
    wanted = settings.max_connections + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the limit we have
    limit = -1 if soft == resource.RLIM_INFINITY else soft
    cap = connection_cap(settings.max_connections, reserve, limit)
    if cap < settings.max_connections:
        logging.getLogger("rollout_session").warning(
            "the file descriptor limit (%d) holds %d client connections, not "
            "--max-connections %d: connections are capped at %d",
            soft,
            cap,
            settings.max_connections,
            cap,
        )
    return cap


def run_or_explain(function: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """``trio.run(function, *args)``; a failed start (module doc) is printed
    as ``rollout-session: cannot start: …`` and exits 1."""
    try:
        return trio.run(function, *args)
    except BaseException as exc:
        reason = _startup_failure(exc)
        if reason is None:
            raise
        print(f"rollout-session: cannot start: {reason}", file=sys.stderr)
        sys.exit(1)


def _startup_failure(exc: BaseException) -> str | None:
    """Why the server could not start, found inside `exc`: the address could
    not be bound, the journal could not be opened, a start-up step exited
    with a message (e.g. ``--demo`` without its extra), or the app's
    start-up failed (hypercorn reports that as a lifespan failure); trio
    wraps any of them in exception groups."""
    from hypercorn.utils import LifespanFailureError

    from ..http.serving import CannotListen
    from ..session.journal.format import JournalError

    if isinstance(exc, CannotListen | JournalStartFailed | JournalError):
        return str(exc)
    if isinstance(exc, SystemExit) and isinstance(exc.code, str):
        return exc.code
    if isinstance(exc, LifespanFailureError):
        # Raised while handling the app's own exception: that one says why.
        cause = exc.__cause__ or exc.__context__
        return str(cause) if cause is not None else str(exc)
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            reason = _startup_failure(inner)
            if reason is not None:
                return reason
    return None
