"""Server-driven session life: idle expiry, the keep-closed window, pausing.

- Idle TTL: a session idle longer than its ``ttl_s`` (or ``--session-ttl-s``)
  becomes ``expired``: its in-flight turn is cancelled, it takes no more turns,
  but its document stays readable until collected or ``--keep-closed-s``
  passes. Dropping an uncollected document is logged at WARNING with its id:
  never silent.
- A collected session stays readable for ``--keep-collected-s`` after its
  DELETE began (so a lost answer can be fetched again), then is forgotten.
- Pause (weight sync): new turns wait for resume up to ``--pause-wait-s``,
  then 503 ``server_paused``; in-flight turns finish, and `PauseGate.pause`
  returns once none is left, so the trainer knows the workers are quiet.

Each change goes through the session store (`SessionStore.expire`,
`SessionStore.forget`); while the journal cannot record changes, the reaper
changes nothing. Time comes from the registry's clock and `trio.sleep`, so
tests drive expiry with trio's autojump clock.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from ..errors import ServerPaused
from .session import SessionState

if TYPE_CHECKING:
    from ..http.context import ServerContext

__all__ = ["PauseGate", "reap_forever", "reap_once"]

logger = logging.getLogger("rollout_session")


def reap_once(ctx: ServerContext) -> None:
    store, settings = ctx.store, ctx.settings
    if not store.writable:
        return  # the journal failed: no change until a restart (SessionStore)
    now = store.clock()
    for session in store.registry:
        if session.state is SessionState.OPEN:
            ttl = session.ttl_s if session.ttl_s is not None else settings.session_ttl_s
            # A turn in flight is activity: a long generation is not idleness.
            # Its release restarts the idle clock.
            if ttl is not None and session.slot is None and now - session.last_active_at > ttl:
                logger.info("session %s expired after %.0f s idle", session.id, ttl)
                store.expire(session)
        elif (
            session.state is SessionState.EXPIRED
            and session.closed_at is not None
            and now - session.closed_at > settings.keep_closed_s
        ):
            logger.warning(
                "dropping expired session %s: not collected within %.0f s",
                session.id,
                settings.keep_closed_s,
            )
            store.forget(session)
    for session in store.registry.collected():
        if session.closed_at is None or now - session.closed_at > settings.keep_collected_s:
            logger.debug("forgetting collected session %s", session.id)
            store.forget(session)


async def reap_forever(ctx: ServerContext, interval_s: float = 1.0) -> None:
    while True:
        reap_once(ctx)
        await trio.sleep(interval_s)


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
