"""Worker-side KV sessions (`--kv-sessions`, docs/kv-sessions.md).

A session's turns already go to one worker, whose radix cache usually still
holds the history's KV; this module decides what else the worker is told:

- ``off``: nothing. Every turn sends the full `input_ids`.
- ``hint``: SGLang's `session_id` on each turn (its KV is kept under that
  id) and `/close_session` when the session closes or moves.
- ``stream``: an SGLang *streaming session* holds the session's context on
  its worker. It is opened before the first turn that needs it, primed with
  the full `input_ids`; each later turn sends only the ids after what the
  worker holds (`session_params`), and SGLang appends them to the previous
  prompt and output. The worker's context is then exactly the trajectory's:
  validation checks the prompt length the worker reports against the
  trajectory's, as for any turn.

Whenever the worker cannot be trusted to hold exactly the trajectory's
prefix, the turn *rebuilds*: the old worker session is closed and a fresh
one is primed with the full `input_ids` — one more control call
(`/open_session`), never a wrong context and never a failed turn. Each
rebuild is counted (`rollout_kv_sessions_opened_total{cause}`) and logged
with its `Rebuild` cause.
"""

from __future__ import annotations

import enum
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .upstream import UpstreamReply

if TYPE_CHECKING:
    from .metrics import Metrics
    from .sessions import Session
    from .turn_commit import TurnPlan
    from .workers import Worker, WorkerPool

__all__ = ["KV_MODES", "PRIORITY_RANGE", "KvHold", "KvMode", "KvSessions", "Rebuild"]

logger = logging.getLogger("rollout_session")


class KvMode(enum.Enum):
    OFF = "off"  # full input_ids, nothing else
    HINT = "hint"  # full input_ids plus SGLang's session_id; /close_session at the end
    STREAM = "stream"  # an SGLang streaming session; later turns send only new ids


KV_MODES = tuple(m.value for m in KvMode)

# SGLang's own check of a request's `priority` (tokenizer_manager).
PRIORITY_RANGE = "priority must be a signed 64-bit integer"


def is_priority(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63


class Rebuild(enum.Enum):
    """Why a turn opened a fresh worker session and sent the full context."""

    NEW = "new"  # the session's first turn (not a rebuild)
    NOT_HELD = "not_held"  # none held: a server restart, or the last open failed
    MOVED = "moved"  # the session's worker changed (failover re-pin, a connect retry)
    # A new segment, a retry or a rollback: the prompt leaves the held context.
    BRANCHED = "branched"
    # The last turn sent was not committed: what the worker holds is unknown.
    UNSETTLED = "unsettled"
    UNAPPENDABLE = "unappendable"  # the new ids are empty or start with BOS (SGLang strips it)
    LOST = "lost"  # the worker answered that it does not hold the session (restart, timeout)


# `KvHold.tokens` while a turn sent on the hold is not committed.
_UNSETTLED = -1

# What SGLang 0.5.23 answers (400) to a turn on a session it does not hold,
# or one it is closing, or that still runs a request (scheduler,
# session_controller); after any of them a fresh session is safe.
_LOST_MARKS = (b"does not exist", b"close was requested", b"already has an active request")


@dataclass(slots=True)
class KvHold:
    """A streaming SGLang session that holds this session's context on a worker.

    Invariant: while ``tokens >= 0`` the worker's context is exactly the
    first ``tokens`` ids of segment ``segment``'s trajectory (its prompt and
    output of the last committed turn)."""

    worker: str  # the worker's base URL
    remote_id: str  # the SGLang session id (fresh per open: a closing one may linger)
    segment: int  # index of the segment it holds
    tokens: int = _UNSETTLED


# Builds the upstream body from the ids to send and the `session_params`.
BodyFor = Callable[["Any", "dict[str, Any] | None"], bytes]


class KvSessions:
    """The turn path's side of `--kv-sessions`: what one turn sends, and the
    hold it leaves. Called under the session's turn slot only."""

    def __init__(
        self,
        mode: KvMode,
        pool: WorkerPool,
        metrics: Metrics,
        *,
        bos_id: int | None,
        timeout_s: float | None,
        default_ttl_s: float | None,
        context_length: Callable[[], int | None],
    ) -> None:
        self.mode = mode
        self._pool = pool
        self._metrics = metrics
        self._bos_id = bos_id
        self._timeout_s = timeout_s
        self._default_ttl_s = default_ttl_s
        self._context_length = context_length

    async def chat(self, session: Session, plan: TurnPlan, body_for: BodyFor) -> UpstreamReply:
        """Send the turn to the session's worker: in `stream` mode the ids the
        worker does not hold yet, rebuilding its session when needed (and once
        more if the worker answers that it lost it)."""
        if self.mode is not KvMode.STREAM:
            payload = body_for(plan.input_ids, None)

            async def fixed(worker: Worker) -> bytes:
                return payload

            return await self._pool.chat(session, fixed)

        lost = False

        async def streamed(worker: Worker) -> bytes:
            ids, params = await self._prepare(session, plan, worker, lost=lost)
            return body_for(ids, params)

        reply = await self._pool.chat(session, streamed)
        if session.kv is not None and _lost(reply):
            # Not the agent's error but the worker's state: rebuilt at once,
            # so the agent never sees it.
            lost = True
            reply = await self._pool.chat(session, streamed)
        return reply

    def settle(self, session: Session, plan: TurnPlan, sampled: int, worker: str) -> None:
        """The turn committed: the worker holds its prompt and output now."""
        hold = session.kv
        if hold is not None and hold.worker == worker:
            hold.segment = len(session.earlier)
            hold.tokens = len(plan.input_ids) + sampled

    async def _prepare(
        self, session: Session, plan: TurnPlan, worker: Worker, *, lost: bool
    ) -> tuple[Any, dict[str, Any] | None]:
        hold = session.kv
        cause = Rebuild.LOST if lost else self._cause(session, plan, worker.url, hold)
        if cause is None:
            assert hold is not None
            hold.tokens = _UNSETTLED  # until the turn commits
            return plan.prompt_ids, {"id": hold.remote_id}
        if hold is not None:
            session.kv = None
            self._pool.close_kv_session(hold.worker, hold.remote_id)
        self._metrics.kv_opened.labels(cause.value).inc()
        if cause is not Rebuild.NEW:
            logger.info(
                "session %s: worker KV session rebuilt on %s (%s): the full context is sent",
                session.id,
                worker.url,
                cause.value,
            )
        remote_id = f"{session.id}.{uuid.uuid4().hex[:12]}"
        ttl = session.ttl_s if session.ttl_s is not None else self._default_ttl_s
        opened = await self._pool.open_kv_session(
            worker,
            remote_id,
            timeout_s=self._timeout_s if self._timeout_s is not None else ttl,
            capacity=self._context_length() or 0,
        )
        if not opened:
            # Logged once per worker by the pool; the turn goes on without a
            # worker session (the full ids, like `off`) and the next one tries again.
            return plan.input_ids, None
        session.kv = KvHold(worker.url, remote_id, len(session.earlier))
        return plan.input_ids, {"id": remote_id}

    def _cause(
        self, session: Session, plan: TurnPlan, worker: str, hold: KvHold | None
    ) -> Rebuild | None:
        """Why this turn cannot append to the held context (None: it can)."""
        if hold is None:
            fresh = not session.trajectory.turns and not session.earlier
            return Rebuild.NEW if fresh else Rebuild.NOT_HELD
        if hold.worker != worker:
            return Rebuild.MOVED
        if hold.tokens == _UNSETTLED:
            return Rebuild.UNSETTLED
        if (
            plan.branch is not None
            or plan.rollback is not None
            or hold.segment != len(session.earlier)
            or hold.tokens != len(session.trajectory)
        ):
            return Rebuild.BRANCHED
        # commit_turn checks that the prompt is the kept trajectory plus
        # `prompt_ids`; with every turn kept, that is the held context plus them.
        new = plan.prompt_ids
        if not new or (self._bos_id is not None and new[0] == self._bos_id):
            return Rebuild.UNAPPENDABLE
        return None


def _lost(reply: UpstreamReply) -> bool:
    return reply.status == 400 and any(mark in reply.body for mark in _LOST_MARKS)
