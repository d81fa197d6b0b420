"""Sessions and their trajectories: what the server keeps, and every change to it.

Owns: the session (state enum, the one-turn slot, the registry), its token
trajectory and segments, the rescores stored with it (`rescores`), its
stored conversation, applying a turn
(`commit`), the session store (`store`: the one owner of every life-cycle
change, with the journal), idle expiry, and the journal (`journal/`).

May import: `prompt`, `errors`, `tokens`. Never an engine, a route or the
turn runner: the store meets the engine only through `SessionEngine`
(adopt / release a session's pin), and a turn reaches it as a `Sampled`
record, not a worker's answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .session import Session, SessionRegistry, SessionState
    from .store import SessionStore
    from .trajectory import Trajectory, Turn

__all__ = ["Session", "SessionRegistry", "SessionState", "SessionStore", "Trajectory", "Turn"]

_HOME = {
    "Session": ".session",
    "SessionRegistry": ".session",
    "SessionState": ".session",
    "SessionStore": ".store",
    "Trajectory": ".trajectory",
    "Turn": ".trajectory",
}

__getattr__, __dir__ = lazy_attributes(__name__, _HOME, __all__)
