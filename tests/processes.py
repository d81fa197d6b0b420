"""Child processes for tests, scripts and the demo-less CLI checks.

`start_listening` starts a command (``rollout-session serve`` / ``emulator``)
in a nursery and returns once it printed its ``… listening on URL`` line, so
callers wait on the event itself, never on a sleep.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Mapping, Sequence

import trio

__all__ = ["start_listening"]


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    # Keep reading so a chatty child never blocks on a full pipe.
    async for _ in stream:
        pass


async def start_listening(
    nursery: trio.Nursery,
    command: Sequence[str],
    *,
    marker: str = "listening on ",
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> tuple[str, trio.Process]:
    """Start `command`; return (the URL after `marker` in its output, the process)."""
    process: trio.Process = await nursery.start(
        functools.partial(
            trio.run_process,
            list(command),
            stdout=subprocess.PIPE,
            check=False,
            env=dict(env) if env is not None else None,
        )
    )
    assert process.stdout is not None
    buffer = b""
    with trio.fail_after(timeout_s):
        async for chunk in process.stdout:
            buffer += chunk
            for line in buffer.decode(errors="replace").splitlines():
                if marker in line:
                    nursery.start_soon(_drain, process.stdout)
                    return line.rsplit(" ", 1)[1], process
    raise RuntimeError(f"{command[0]} exited before listening: {buffer.decode(errors='replace')}")
