"""Pausing turns for a weight sync: `PauseGate`.

New turns wait for resume up to ``--pause-wait-s``, then 503
``server_paused``; in-flight turns finish, and `PauseGate.pause` returns once
none is left, so the trainer knows the workers are quiet.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from ..errors import ServerPaused

__all__ = ["PauseGate"]


class PauseGate:
    """Turns pass while open; `pause` closes it and waits for in-flight turns."""

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._open = trio.Event()
        self._open.set()
        self.inflight = 0
        self._idle = trio.Event()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def pause(self) -> None:
        if not self.paused:
            self._open = trio.Event()
        while self.inflight:
            await self._idle.wait()

    def resume(self) -> None:
        self._open.set()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Admit one turn (waiting out a pause) and count it while it runs."""
        if self.paused:
            with trio.move_on_after(self._wait_s):
                await self._open.wait()
            if self.paused:
                raise ServerPaused(
                    "turns are paused for a weight update",
                    retry_after_s=max(1, math.ceil(self._wait_s)),
                )
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
            if not self.inflight:
                self._idle.set()
                self._idle = trio.Event()
