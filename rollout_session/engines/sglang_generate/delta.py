"""Delta-sync (`--kv-sessions delta`): each turn sends only the ids the worker
does not hold, over SGLang's non-streaming sessions (docs/kv-sessions.md).

An SGLang session (``/open_session``) remembers each finished request's
context: ``session_params {id, rid}`` on ``/generate`` continues from
request ``rid``'s prompt plus its output ids (``Session.create_req`` in
``sglang/srt/session/session_controller.py``), so the next turn sends only
what the trajectory appended after them. The worker's ``prompt_tokens``
(the whole rebuilt context) is checked against the trajectory's prompt
length on every turn by the answer check.

`RemoteSessions` owns which worker-side session a session uses and what
that session holds (its worker, its id, the last request, the length and a
digest of the ids it holds). Mutation is plain synchronous code; the engine
does the I/O. A state that cannot be trusted is dropped, never patched: the
next turn rebuilds — a fresh worker session primed with the whole prompt.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...tokens import IdArray

__all__ = ["Plan", "Rebuild", "RemoteSession", "RemoteSessions", "dp_rank", "lost_session"]

logger = logging.getLogger("rollout_session")

# SGLang's own messages for a request on a session the worker does not hold
# (Scheduler._handle_generate_request; Session.create_req).
_LOST = (
    "does not exist",
    "Invalid request session id",
    "close was requested",
)


def lost_session(message: str) -> bool:
    """Whether a worker's 400 says it no longer holds the session."""
    return any(part in message for part in _LOST)


class Rebuild(enum.Enum):
    """Why a turn primes a fresh worker session (counted, logged)."""

    FIRST = "first"  # the session's first turn on this engine (not a rebuild)
    MOVED = "moved"  # pinned to another worker than the one holding its session
    BRANCHED = "branched"  # the prompt does not extend what the worker holds
    LOST = "lost"  # the worker answered that it does not hold the session
    DROPPED = "dropped"  # an earlier turn's answer could not be trusted


@dataclass(frozen=True, slots=True)
class RemoteSession:
    """What one worker-side session holds (after its last finished request)."""

    worker: str
    remote_id: str
    last_rid: str
    length: int  # ids the worker holds: the last request's context + its output
    digest: bytes  # of those ids


@dataclass(frozen=True, slots=True)
class Plan:
    """How one turn is sent: the ids to send and the session parameters."""

    input_ids: IdArray
    session_params: dict[str, Any]
    remote_id: str
    rebuild: Rebuild | None  # None: a delta on the session the worker holds


def dp_rank(session_id: str, dp_size: int) -> int | None:
    """The data-parallel rank a session's requests are pinned to: SGLang
    opens a session on every rank (``/open_session`` is a control message the
    data-parallel controller sends to all), but a request's history lives on
    the rank that served it, so every turn must reach the same one."""
    if dp_size <= 1:
        return None
    return zlib.crc32(session_id.encode()) % dp_size


def digest(ids: IdArray) -> bytes:
    return hashlib.blake2b(
        np.ascontiguousarray(ids, dtype=np.int32).tobytes(), digest_size=16
    ).digest()


class RemoteSessions:
    """Every session's worker-side session, for one engine."""

    def __init__(self) -> None:
        self._held: dict[str, RemoteSession] = {}
        self._generation: Counter[str] = Counter()  # per session: worker sessions opened
        self.rebuilds: Counter[str] = Counter()  # Rebuild.value -> turns primed for it
        self.delta_turns = 0

    def plan(self, session_id: str, worker: str | None, prompt: IdArray) -> Plan:
        """The request for a turn of `session_id` on `worker` with this prompt."""
        held = self._held.get(session_id)
        cause: Rebuild
        if held is None:
            cause = Rebuild.DROPPED if self._generation[session_id] else Rebuild.FIRST
        elif held.worker != worker:
            cause = Rebuild.MOVED
        elif len(prompt) <= held.length or digest(prompt[: held.length]) != held.digest:
            cause = Rebuild.BRANCHED
        else:
            return Plan(
                prompt[held.length :],
                {"id": held.remote_id, "rid": held.last_rid},
                held.remote_id,
                None,
            )
        return self._fresh(session_id, prompt, cause)

    def rebuild(self, session_id: str, prompt: IdArray, cause: Rebuild) -> Plan:
        """A fresh worker session for a turn whose delta could not be sent."""
        return self._fresh(session_id, prompt, cause)

    def _fresh(self, session_id: str, prompt: IdArray, cause: Rebuild) -> Plan:
        self._generation[session_id] += 1
        # Unique across restarts: a worker may still hold an earlier server's.
        remote_id = f"{session_id}-{uuid.uuid4().hex[:12]}"
        self.rebuilds[cause.value] += 1
        if cause is not Rebuild.FIRST:
            logger.info("session %s: worker session rebuilt (%s)", session_id, cause.value)
        return Plan(prompt, {"id": remote_id}, remote_id, cause)

    def finished(
        self, session_id: str, worker: str, plan: Plan, rid: str, prompt: IdArray, output: IdArray
    ) -> None:
        """The turn's answer was checked: the worker holds prompt + output."""
        if plan.rebuild is None:
            self.delta_turns += 1
        held = np.concatenate([np.asarray(prompt, np.int32), np.asarray(output, np.int32)])
        self._held[session_id] = RemoteSession(worker, plan.remote_id, rid, len(held), digest(held))

    def drop(self, session_id: str) -> RemoteSession | None:
        """Forget the session's worker session (the caller closes it)."""
        return self._held.pop(session_id, None)

    def forget(self, session_id: str) -> RemoteSession | None:
        """The session is gone: nothing of it is kept."""
        self._generation.pop(session_id, None)
        return self._held.pop(session_id, None)

    def held(self) -> list[RemoteSession]:
        return list(self._held.values())

    def __len__(self) -> int:
        return len(self._held)
