"""Sending one request to a worker: the pool's one entry for engines.

`Dispatch.send` is the whole path of an engine's request through the pool,
in order, without coming back: wait while new requests are held (a
pause in abort mode) → the worker (the session's pin, placed or moved by `Placer`;
or the worker a follow-up names) → its keep-alive client (`client.post`)
→ the answer's strict check, where the engine's `Validation` puts it →
the outcome on the worker's circuit (`Breaker`). The engine gets back the
reply and, for a 200 it asked to be checked, the checked answer.

Failover: a connect error — nothing reached the worker — is retried once on
another eligible worker; anything after sending is not retried (the GPU may
have done the work), except a continuation (`resend_if_gone`: it holds
sampled work) whose worker's ``/health`` fails too: that worker is gone, and
whatever it did with it.

What counts on the circuit: transport errors (not timeouts: slowness is
not death), 5xx answers, answers over ``--max-answer-mb`` and answers that
fail their check count as failures; a 200 that passes its check is a
success; a 200 sent without a check, and every 4xx, count neither way. A
refusal because the worker's trainer paused it is neither: the request
waits for the worker to resume and is sent again (`paused.Pauses`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio

from ...errors import NoHealthyWorker, UpstreamError, UpstreamMalformed
from ..base import EngineSession, Validation
from .circuit import Breaker
from .client import NotSent, UpstreamReply, post
from .health import HealthChecks
from .interrupts import Interrupts
from .membership import Membership
from .options import PoolOptions
from .paused import Pauses
from .placement import Placer
from .worker import Worker

__all__ = ["Check", "Dispatch", "Sent", "WorkerRequest"]

logger = logging.getLogger("rollout_session")

A = TypeVar("A")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Check(Generic[A, T]):
    """A 200's strict check, ``run(body, arg)``: a pure, picklable
    module-level function, run where the validation's cost rule puts it.
    Its result is `Sent.answer`; `UpstreamMalformed` from it counts against
    the worker."""

    run: Callable[[bytes, A], T]
    arg: A
    # The bytes of a body that cost decode time (where the check runs is
    # decided on it); None: the body's length.
    cost: Callable[[bytes], int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRequest(Generic[T]):
    """One request an engine sends a worker, and how its 200 is checked."""

    path: str
    body: bytes
    # The id the body names the request by: a pause in abort mode aborts it
    # by it (None: not abortable).
    request_id: str | None = None
    # This worker exactly (a request that belongs to a turn it answered, or
    # a scoring request to the worker chosen for it): no pin, no retry.
    # None: the session's pinned worker, placed or moved, with failover.
    worker: str | None = None
    # A continuation (it holds sampled work): after a transport error once
    # sent, a worker whose /health fails too is gone; send it to another.
    resend_if_gone: bool = False
    # None: a 200 is returned unchecked and counts neither way.
    check: Check[Any, T] | None = None


@dataclass(frozen=True, slots=True)
class Sent(Generic[T]):
    """A worker's reply; for a checked 200, the checked answer too."""

    reply: UpstreamReply
    answer: T | None = None

    @property
    def checked(self) -> T:
        """The checked answer (a 200 sent with a check)."""
        assert self.answer is not None, "no checked answer: not a 200, or sent without a check"
        return self.answer


class Dispatch:
    def __init__(
        self,
        members: Membership,
        options: PoolOptions,
        placer: Placer,
        breaker: Breaker,
        health: HealthChecks,
        interrupts: Interrupts,
        pauses: Pauses,
        validation: Validation,
    ) -> None:
        self._members = members
        self._options = options
        self._placer = placer
        self._breaker = breaker
        self._health = health
        self._interrupts = interrupts
        self._pauses = pauses
        self._validation = validation

    async def send(self, session: EngineSession, request: WorkerRequest[T]) -> Sent[T]:
        """Send `request` for `session` (see the module for the path, the
        failover and what counts on the circuit)."""
        if request.worker is not None:
            reply = await self._post(self._member(request.worker), session.id, request)
        else:
            await self._interrupts.wait_to_send()
            reply = await self._pinned(session, request)
        check = request.check
        if reply.status != 200 or check is None:
            return Sent(reply)
        worker = self._members.workers.get(reply.worker)
        cost = len(reply.body) if check.cost is None else check.cost(reply.body)
        try:
            answer = await self._validation.validate(check.run, reply.body, check.arg, cost)
        except UpstreamMalformed as exc:
            if worker is not None:
                self._breaker.failed(
                    worker, f"{exc.kind}: {exc.message}", answered=True, session=session.id
                )
            raise
        if worker is not None:
            self._breaker.succeeded(worker)
        return Sent(reply, answer)

    def _member(self, url: str) -> Worker:
        worker = self._members.workers.get(url)
        if worker is None:
            raise UpstreamError(f"worker {url} left the pool during the turn")
        return worker

    async def _pinned(self, session: EngineSession, request: WorkerRequest[Any]) -> UpstreamReply:
        worker = self._placer.pin(session)
        try:
            return await self._post(worker, session.id, request)
        except NotSent as not_sent:
            first: Exception = not_sent  # nothing reached that worker: a retry is safe
        except UpstreamError as lost:
            gone = await self._health.failure(worker) if request.resend_if_gone else None
            if gone is None:
                raise
            logger.warning(
                "worker %s: a continuation failed (%s) and the worker is gone (%s); "
                "sending it to another worker",
                worker.url,
                lost,
                gone,
            )
            first = lost
        try:
            retry = self._placer.pin(session, exclude=worker.url)
        except NoHealthyWorker:
            raise UpstreamError(str(first)) from None
        try:
            return await self._post(retry, session.id, request)
        except NotSent as second:
            raise UpstreamError(str(second)) from None

    async def _post(
        self, worker: Worker, session_id: str, request: WorkerRequest[Any]
    ) -> UpstreamReply:
        """One exchange with `worker`; a refusal because someone else paused
        it is waited out and the request sent again (`paused.Pauses`)."""
        paused = self._options.dialect.paused
        deadline = trio.current_time() + self._options.worker_pause_wait_s
        while True:
            reply = await self._post_once(worker, session_id, request)
            if paused is None or not paused(reply):
                self._pauses.ended(worker)
                break
            await self._pauses.wait(worker, deadline)
        if reply.status >= 500:
            logger.info("worker %s answered a request with %d", worker.url, reply.status)
            self._breaker.failed(
                worker, f"answered a turn with {reply.status}", answered=True, session=session_id
            )
        return reply

    async def _post_once(
        self, worker: Worker, session_id: str, request: WorkerRequest[Any]
    ) -> UpstreamReply:
        options = self._options
        worker.started(request.request_id)
        try:
            reply = await post(
                worker.client,
                request.path,
                request.body,
                session_id=session_id,
                session_headers=options.dialect.session_headers,
                timeout_s=options.upstream_timeout_s,
                max_bytes=options.max_answer_bytes,
            )
        except (NotSent, UpstreamError) as exc:
            # UpstreamTimeout is not caught here: slowness is not death.
            self._breaker.failed(worker, str(exc), answered=False, session=session_id)
            raise
        except UpstreamMalformed as exc:  # an answer over --max-answer-mb
            self._breaker.failed(worker, str(exc), answered=True, session=session_id)
            raise
        finally:
            worker.finished(request.request_id)
        return reply
