"""Running an ASGI app on hypercorn's trio worker inside a caller's nursery.

One helper for the CLI, the demo, tests and benchmarks: bind (port 0 picks a
free port), report the bound URL, and shut down gracefully when asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.typing import Framework

__all__ = ["RunningServer", "hypercorn_config", "start_server"]


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


@dataclass
class RunningServer:
    """A server started by `start_server`; `url` has no trailing slash."""

    url: str
    _stop: trio.Event = field(default_factory=trio.Event)
    _stopped: trio.Event = field(default_factory=trio.Event)

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
    **config_overrides: Any,
) -> RunningServer:
    """Start `app` in `nursery` and return once it is accepting connections."""
    config = hypercorn_config(host, port)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    stop, stopped = trio.Event(), trio.Event()

    async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
        finally:
            stopped.set()

    binds: list[str] = await nursery.start(run)
    return RunningServer(url=binds[0], _stop=stop, _stopped=stopped)
