"""Pausing turns for a weight sync: `PauseGate`.

While paused, new turns wait for resume up to ``--pause-wait-s``, then 503
``server_paused``. `pause` in ``drain`` mode returns once no turn is at a
worker, so the trainer knows the workers are quiet; in ``abort`` mode it
interrupts the turns at their workers (each answers ``abort`` with what it
sampled) and returns at once. A turn its worker interrupted waits here for
resume (however long: it holds sampled work) and is then continued; while
it waits it is not at a worker, so a drain does not wait for it. A new turn
whose session stops taking turns while it waits (a DELETE, expiry) stops
waiting at once: its session's `stop` event wakes it (`turn`), and it is
refused as the session refuses turns (404), not after the whole wait.
"""

from __future__ import annotations

import enum
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

from ..errors import ServerPaused

__all__ = ["PauseGate", "PauseMode"]


class PauseMode(enum.Enum):
    # Wait for the turns at workers to finish.
    DRAIN = "drain"
    # Interrupt them (abort at their workers): they continue after resume.
    ABORT = "abort"


class PauseGate:
    """Turns pass while open; `pause` closes it (see the module)."""

    def __init__(
        self,
        wait_s: float,
        *,
        interrupt: Callable[[], Awaitable[int]] | None = None,
        resume_sending: Callable[[], None] | None = None,
    ) -> None:
        self._wait_s = wait_s
        # Abort the turn requests at workers and hold new ones (the pool's).
        self._interrupt = interrupt
        self._resume_sending = resume_sending
        self._open = trio.Event()
        self._open.set()
        # Turns admitted and not waiting to continue: at (or on their way
        # to) a worker.
        self.inflight = 0
        self.waiting = 0  # interrupted turns waiting for resume
        self.held = 0  # new turns waiting to be admitted
        self._idle = trio.Event()
        # The policy version the trainer declared on resume (None: none yet):
        # it names tokens whose engine reports no version.
        self.declared_version: str | None = None

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def pause(self, mode: PauseMode = PauseMode.DRAIN) -> int:
        """Close the gate. DRAIN: return once no turn is at a worker (0).
        ABORT: interrupt the turns at workers; return how many were asked."""
        if not self.paused:
            self._open = trio.Event()
        if mode is PauseMode.ABORT:
            return await self._interrupt() if self._interrupt is not None else 0
        while self.inflight:
            await self._idle.wait()
        return 0

    def resume(self, weight_version: str | None = None) -> None:
        if weight_version is not None:
            self.declared_version = weight_version
        if self._resume_sending is not None:
            self._resume_sending()
        self._open.set()

    @asynccontextmanager
    async def turn(self, stop: trio.Event | None = None) -> AsyncIterator[bool]:
        """Admit one turn (waiting out a pause) and count it while it runs:
        yields True. `stop` (its session's `Session.stopped`) ends a wait at
        once when set: the turn is then neither admitted nor counted, and
        False is yielded (its caller refuses it as its session says)."""
        if self.paused:
            self.held += 1
            try:
                with trio.move_on_after(self._wait_s):
                    await self._wait_open(stop)
            finally:
                self.held -= 1
            if stop is not None and stop.is_set():
                yield False
                return
            if self.paused:
                raise ServerPaused(
                    "turns are paused for a weight update",
                    retry_after_s=max(1, math.ceil(self._wait_s)),
                )
        self.inflight += 1
        try:
            yield True
        finally:
            self._leave()

    async def _wait_open(self, stop: trio.Event | None) -> None:
        """Until the gate opens or `stop` is set, whichever comes first."""
        if stop is None:
            await self._open.wait()
            return
        async with trio.open_nursery() as nursery:

            async def first(event: trio.Event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(first, self._open)
            nursery.start_soon(first, stop)

    async def wait_to_continue(self) -> float:
        """An admitted turn its worker interrupted: wait (uncounted) until
        the gate is open; return the seconds waited."""
        if not self.paused:
            return 0.0
        started = trio.current_time()
        self._leave()
        self.waiting += 1
        try:
            await self._open.wait()
        finally:
            self.waiting -= 1
            self.inflight += 1
        return trio.current_time() - started

    def _leave(self) -> None:
        self.inflight -= 1
        if not self.inflight:
            self._idle.set()
            self._idle = trio.Event()
