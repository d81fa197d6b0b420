"""Server-driven session life: idle expiry and the keep-closed window.

- Idle TTL: a session idle longer than its ``ttl_s`` (or ``--session-ttl-s``)
  becomes ``expired``: its in-flight turn is cancelled, it takes no more turns,
  but its document stays readable until collected or ``--keep-closed-s``
  passes. Dropping an uncollected document is logged at WARNING with its id:
  never silent.
- A collected session stays readable for ``--keep-collected-s`` after its
  DELETE began (so a lost answer can be fetched again), then is forgotten.

Each change goes through the session store (`SessionStore.expire`,
`SessionStore.forget`); while the journal cannot record changes, the reaper
changes nothing. Time comes from the registry's clock and `trio.sleep`, so
tests drive expiry with trio's autojump clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from .session import SessionState
from .store import SessionStore

__all__ = ["Expiry"]

logger = logging.getLogger("rollout_session")


@dataclass(frozen=True)
class Expiry:
    """The reaper: what it reads is the store and the three windows."""

    store: SessionStore
    # --session-ttl-s: idle seconds before an open session expires, for
    # sessions created without their own `ttl_s`; None = never.
    default_ttl_s: float | None
    keep_closed_s: float  # an expired, uncollected document stays readable
    keep_collected_s: float  # a collected document stays readable (lost answers)

    def once(self) -> None:
        store = self.store
        if not store.writable:
            return  # the journal failed: no change until a restart (SessionStore)
        now = store.clock()
        for session in store.registry:
            if session.state is SessionState.OPEN:
                ttl = session.ttl_s if session.ttl_s is not None else self.default_ttl_s
                # A turn in flight is activity: a long generation is not idleness.
                # Its release restarts the idle clock.
                if ttl is not None and session.slot is None and now - session.last_active_at > ttl:
                    logger.info("session %s expired after %.0f s idle", session.id, ttl)
                    store.expire(session)
            elif (
                session.state is SessionState.EXPIRED
                and session.closed_at is not None
                and now - session.closed_at > self.keep_closed_s
            ):
                logger.warning(
                    "dropping expired session %s: not collected within %.0f s",
                    session.id,
                    self.keep_closed_s,
                )
                store.forget(session)
        for session in store.registry.collected():
            if session.closed_at is None or now - session.closed_at > self.keep_collected_s:
                logger.debug("forgetting collected session %s", session.id)
                store.forget(session)

    async def forever(self, interval_s: float = 1.0) -> None:
        while True:
            self.once()
            await trio.sleep(interval_s)
