"""Rescoring a session: the logprobs of exactly its tokens under another
policy, one prefill-only request per segment (docs/training.md#rescoring).

``POST /sessions/{id}/rescore`` names the target (``pinned``: the worker the
session's turns go to; ``teacher``: one of ``--teacher-worker``, chosen per
session; or the URL of a worker in either pool), a label, and which
positions to keep (``sampled`` or ``all``). Each segment's ids are sent as
they are stored — never re-tokenised — through the pool's dialect
(`engines/scoring.py`), and every answer is validated like a turn's: the
ids it scores are the ids sent, and every kept position has one finite
logprob ≤ 0, or the rescore fails with a 502 and stores nothing. A scoring
request the engine aborted before it scored every position (a weight
update at the worker) is not the worker's fault: it is sent again, up to
``--max-continuations`` times as an aborted turn is continued, then 503
``rescore_interrupted``.

All or nothing, and never misaligned: the answers are stored together, in
one synchronous step, and only on segments whose first tokens are still
the ones scored (a turn may commit meanwhile — it extends the segment, and
the rescore covers the prefix it scored — or roll back a turn and
re-sample: then 409, nothing stored), and only if the session was not
collected meanwhile: a DELETE answered while the rescore ran handed the
trainer a document without it, and a later DELETE must answer that same
document, so the late rescore is refused (404 ``session_closing``, nothing
stored). A session collected before the rescore began is rescored as asked.

``pinned`` is the worker the session is pinned to, or, once it is closed
(expired, collected: unpinned), the one it was last pinned to
(`Session.last_worker`). A session keeps at most `MAX_LABELS` labels: each
is a float per token of every segment in every export.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np
import numpy.typing as npt

from ..engines.pool import Check, WorkerPool, WorkerRequest
from ..engines.scoring import ScoreCheck, Scores, check_scores
from ..errors import (
    InvalidRequest,
    RescoreInterrupted,
    SessionBusy,
    SessionClosing,
    SessionNotFound,
    UpstreamError,
)
from ..session.rescores import Positions, Rescore
from ..session.session import Session, SessionRegistry, SessionState
from ..session.trajectory import Trajectory
from ..tokens import IdArray

__all__ = ["MAX_LABELS", "RescoreRequest", "Rescorer", "parse_rescore"]

# Labels a session keeps rescores under: each is a float per token of every
# segment, in every export (1,000 labels made a 64 MB export).
MAX_LABELS = 16

logger = logging.getLogger("rollout_session")

_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_FIELDS = frozenset({"target", "label", "positions"})


@dataclass(frozen=True, slots=True)
class RescoreRequest:
    target: str  # "pinned", "teacher" or a worker's URL
    label: str
    positions: Positions


def parse_rescore(body: dict[str, Any]) -> RescoreRequest:
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; a rescore takes {sorted(_FIELDS)}", param=unknown[0]
        )
    target = body.get("target")
    if not isinstance(target, str) or not target:
        raise InvalidRequest(
            'target must be "pinned", "teacher" or the URL of a worker', param="target"
        )
    label = body.get("label")
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise InvalidRequest(
            "label must be 1-64 letters, digits or _.:- (starting with a letter or digit)",
            param="label",
        )
    positions = body.get("positions", "sampled")
    if positions not in get_args(Positions):
        raise InvalidRequest('positions must be "sampled" or "all"', param="positions")
    return RescoreRequest(target, label, positions)


@dataclass(frozen=True, slots=True)
class _Scored:
    trajectory: Trajectory
    ids: IdArray
    rescore: Rescore


class Rescorer:
    def __init__(
        self,
        registry: SessionRegistry,
        pool: WorkerPool,
        teachers: WorkerPool | None,
        clock: Callable[[], float] = time.time,
        *,
        max_resends: int = 8,
    ) -> None:
        self._registry = registry
        # Times an aborted scoring request is sent again (--max-continuations).
        self._max_resends = max_resends
        self._pool = pool
        self._teachers = teachers
        self._clock = clock

    def _route(self, session: Session, target: str) -> tuple[WorkerPool, str]:
        """The pool and the worker that score `session` for `target`."""
        if target == "pinned":
            # A closed session is unpinned: the worker it was pinned to.
            worker = session.worker or session.last_worker
            if worker is None:
                raise InvalidRequest(
                    "the session has no pinned worker yet (no turn was taken)", param="target"
                )
            if not self._pool.knows(worker):
                raise InvalidRequest(
                    f"the worker the session was pinned to, {worker}, is no longer in the "
                    "pool: name a worker or the teacher",
                    param="target",
                )
            served = self._pool.served.model if self._pool.served is not None else None
            if session.model is not None and served is not None and session.model != served:
                # An adapter ("served:adapter", or one vLLM lists by name):
                # scoring the base model instead would be silently wrong.
                raise InvalidRequest(
                    f"the session's turns were sampled by {session.model!r}, not the served "
                    f"model {served!r}: rescoring an adapter is not supported",
                    param="target",
                )
            return self._pool, self._pool.scorer(worker, session.id)
        if target == "teacher":
            if self._teachers is None:
                raise InvalidRequest(
                    "no teacher workers: start the server with --teacher-worker URL",
                    param="target",
                )
            return self._teachers, self._teachers.scorer(None, session.id)
        for pool in (self._pool, self._teachers):
            if pool is not None and pool.knows(target):
                return pool, pool.scorer(target, session.id)
        raise InvalidRequest(
            f'target {target!r} is neither "pinned", "teacher" nor a worker in the pool '
            "or among the teacher workers",
            param="target",
        )

    async def rescore(self, session_id: str, request: RescoreRequest) -> Session:
        """Score every segment of the session and store the rescores under
        `request.label` (replacing one of that label); return the session."""
        session = self._registry.get(session_id)
        if session.state is SessionState.CLOSING:
            raise SessionClosing(
                f"session {session.id} is being collected: rescore it once the DELETE answered"
            )
        collected = session.state is SessionState.COLLECTED
        _check_labels(session, request.label)
        pool, url = self._route(session, request.target)
        model = pool.served.model if pool.served is not None else None
        scored = []
        for segment in session.segments():
            trajectory = segment.trajectory
            # Both before the request: a turn may commit while it is out.
            ids = trajectory.tokens.ids
            keep = trajectory.tokens.mask.astype(bool)
            if request.positions == "all":
                keep[:] = True
                keep[:1] = False  # nothing precedes the first token
            scores = await self._score(pool, url, session, ids, keep, model)
            logprobs = np.where(keep, scores.logprobs, np.float32(np.nan)).astype(np.float32)
            rescore = Rescore(
                logprobs=logprobs,
                positions=request.positions,
                target=request.target,
                worker=url,
                model=model,
                weight_version=scores.weight_version,
                created_at=self._clock(),
            )
            scored.append(_Scored(trajectory, ids, rescore))
        # One synchronous step: check every segment, then store every rescore.
        if self._registry.find(session.id) is not session:
            raise SessionNotFound(
                f"session {session.id} was forgotten while it was rescored: nothing was stored"
            )
        if _collected_since(session, collected):
            raise SessionClosing(
                f"session {session.id} was collected while it was rescored: nothing was "
                "stored (the DELETE's document has no such rescore); rescore the collected "
                "session again and read its trajectory"
            )
        _check_labels(session, request.label)
        for item in scored:
            tokens = item.trajectory.tokens
            n = len(item.ids)
            if len(tokens) < n or not np.array_equal(tokens.prefix_ids(n), item.ids):
                raise SessionBusy(
                    f"session {session.id} rolled back a turn while it was rescored: "
                    "nothing was stored; rescore it again"
                )
        for item in scored:
            item.trajectory.rescores[request.label] = item.rescore
        return session

    async def _score(
        self,
        pool: WorkerPool,
        url: str,
        session: Session,
        ids: IdArray,
        keep: npt.NDArray[np.bool_],
        model: str | None,
    ) -> Scores:
        """The worker's logprobs of `ids`, one at every `keep` position
        (checked like a turn's answer: a failure counts against the worker)."""
        scoring = pool.dialect.scoring
        request = WorkerRequest(
            path=scoring.path,
            body=scoring.body(ids, model or ""),
            worker=url,
            # ~30 bytes of JSON per position: decoded off the loop when large.
            check=Check(check_scores, ScoreCheck(scoring.read, ids, keep)),
        )
        resends = 0
        while True:
            try:
                sent = await pool.send(session, request)
            except RescoreInterrupted as exc:
                # Not counted against the worker: engines abort what runs on a
                # weight update, and the same request scores once sent again.
                if resends == self._max_resends:
                    raise RescoreInterrupted(
                        f"{exc.message}, {resends + 1} time(s) (--max-continuations "
                        f"{self._max_resends}): nothing was stored; rescore it again"
                    ) from None
                resends += 1
                logger.info(
                    "worker %s: %s (session %s); sending it again", url, exc.message, session.id
                )
                continue
            reply = sent.reply
            if reply.status != 200:
                raise UpstreamError(
                    f"worker {url} answered the scoring request with {reply.status}: "
                    f"{reply.body[:300].decode('utf-8', 'replace')}"
                )
            return sent.checked


def _collected_since(session: Session, collected: bool) -> bool:
    """Whether a DELETE began collecting `session` since it was `collected`
    (or not) as a rescore began."""
    state = session.state
    return state is SessionState.CLOSING or (state is SessionState.COLLECTED and not collected)


def _check_labels(session: Session, label: str) -> None:
    """400 for a new label on a session holding `MAX_LABELS` already (one
    already held is replaced)."""
    held = set().union(*(s.trajectory.rescores for s in session.segments()))
    if label not in held and len(held) >= MAX_LABELS:
        raise InvalidRequest(
            f"session {session.id} holds rescores under {len(held)} labels, the most a "
            f"session keeps ({MAX_LABELS}); reuse one of {sorted(held)}",
            param="label",
        )
