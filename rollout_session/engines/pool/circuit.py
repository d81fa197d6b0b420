"""The circuit breaker: health from real traffic (docs/reliability.md#failing-workers).

``circuit_failures`` failed turns in a row — transport errors, 5xx answers,
answers over ``--max-answer-mb``, and answers that fail validation — open a
worker's circuit (no pins). A failure the worker *answered* (a 5xx, an
oversize or invalid answer) may be the request's doing, not the worker's:
one agent's hostile requests must not shut a worker off for every session.
So the breaker asks who failed: failures spread over ``circuit_sessions``
sessions or more are the worker's (a worker that fails real prompts, out
of memory, while a one-token probe passes), and open the circuit; fewer
sessions' failures (one agent's) first get the dialect's one-token probe:
if the worker answers it, they are taken as the requests' (logged, the
count starts over, the circuit stays closed); if not, the circuit opens.
After ``circuit_open_s`` it is half-open: the breaker itself sends probes
(agents' turns never test a worker) until ``circuit_successes`` in a row
close it or one failure reopens it. Timeouts and 4xx answers count neither
way: a long generation is not a dead worker, and a 4xx is the request's
fault. A worker that passes probes but fails real prompts is let back by
its half-open probes, and taken out again by the next sessions' failures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ...errors import UpstreamError, UpstreamMalformed, UpstreamTimeout
from .client import NotSent, post
from .dialect import PROBE_SESSION
from .health import HealthChecks
from .membership import Membership
from .options import PoolOptions
from .worker import Circuit, Health, Worker

__all__ = ["Breaker"]

logger = logging.getLogger("rollout_session")

# What to do with a probe's outcome: its failure, None when it passed.
Then = Callable[[Worker, str | None], None]


class Breaker:
    def __init__(self, members: Membership, options: PoolOptions, health: HealthChecks) -> None:
        self._members = members
        self._options = options
        self._health = health  # the served model the probes ask for

    def succeeded(self, worker: Worker) -> None:
        """`worker` answered a request with a 200 that passed its check."""
        if worker.circuit is Circuit.CLOSED:
            worker.circuit_failures = 0
            worker.failing_sessions.clear()

    def failed(self, worker: Worker, reason: str, *, answered: bool, session: str) -> None:
        """A request of `session` failed at `worker`; `answered`: the worker
        answered (a 5xx, an oversize or invalid answer), which the request
        may have caused, rather than the connection failing."""
        worker.last_error = f"turn: {reason}"
        if worker.circuit is not Circuit.CLOSED:
            return  # a request sent before the circuit opened
        worker.circuit_failures += 1
        worker.failing_sessions.add(session)
        if worker.circuit_failures < self._options.circuit_failures:
            return
        spread = len(worker.failing_sessions)
        if spread >= self._options.circuit_sessions:
            worker.last_error += f" (failed turns of {spread} sessions in a row)"
            self._open(worker)
        elif not answered or not self._start_probe(worker, self._confirm_failures):
            self._open(worker)

    def test(self, worker: Worker) -> None:
        """Each health round: open long enough → half-open; half-open → one
        probe at a time."""
        if (
            worker.circuit is Circuit.OPEN
            and trio.current_time() - worker.circuit_opened_at >= self._options.circuit_open_s
        ):
            worker.circuit = Circuit.HALF_OPEN
            worker.circuit_successes = 0
            logger.info("worker %s: circuit half-open; probing it", worker.url)
            self._members.notify()
        if worker.circuit is Circuit.HALF_OPEN and worker.health is Health.HEALTHY:
            self._start_probe(worker, self._half_open_probed)

    def _open(self, worker: Worker) -> None:
        worker.failing_sessions.clear()
        worker.circuit = Circuit.OPEN
        worker.circuit_opened_at = trio.current_time()
        worker.circuit_successes = 0
        logger.warning(
            "worker %s: circuit open (%s); no new turns for %g s",
            worker.url,
            worker.last_error,
            self._options.circuit_open_s,
        )
        self._members.notify()

    def _start_probe(self, worker: Worker, then: Then) -> bool:
        """Send `worker` one probe unless one is in flight, then call `then`
        with the failure; False when it cannot be sent (the pool is not
        running, or has seen no served model yet)."""
        if worker.probing:
            return True
        served = self._health.served
        if served is None:
            return False
        model = self._options.fixed_upstream_model or served.model
        if not self._members.start_soon(self._probe, worker, model, then):
            return False
        worker.probing = True
        return True

    async def _probe(self, worker: Worker, model: str, then: Then) -> None:
        try:
            reason = await self._probe_failure(worker, model)
        finally:
            worker.probing = False
        if self._members.member(worker):
            then(worker, reason)

    async def _probe_failure(self, worker: Worker, model: str) -> str | None:
        """Why the dialect's one-token probe failed, or None."""
        options = self._options
        probe = options.dialect.probe
        try:
            reply = await post(
                worker.client,
                probe.path,
                probe.body(model),
                session_id=PROBE_SESSION,
                session_headers=options.dialect.session_headers,
                timeout_s=options.upstream_timeout_s,
                max_bytes=options.max_answer_bytes,
            )
            if reply.status != 200:
                return f"probe answered {reply.status}"
            probe.check(reply.body)
        except (NotSent, UpstreamError, UpstreamMalformed, UpstreamTimeout) as exc:
            return f"probe: {exc}"
        return None

    def _confirm_failures(self, worker: Worker, reason: str | None) -> None:
        """The probe sent when answered failures reached the count."""
        if worker.circuit is not Circuit.CLOSED:
            return
        if reason is not None:
            worker.last_error = f"{worker.last_error}; {reason}"
            self._open(worker)
            return
        worker.circuit_excused += 1
        logger.warning(
            "worker %s: %d failed turns in a row (last: %s), but it answers a probe: "
            "taken as the requests' fault; its circuit stays closed",
            worker.url,
            worker.circuit_failures,
            worker.last_error,
        )
        worker.circuit_failures = 0
        worker.failing_sessions.clear()
        self._members.notify()

    def _half_open_probed(self, worker: Worker, reason: str | None) -> None:
        if worker.circuit is not Circuit.HALF_OPEN:
            return
        if reason is not None:
            worker.last_error = reason
            self._open(worker)
            return
        worker.circuit_successes += 1
        if worker.circuit_successes >= self._options.circuit_successes:
            worker.circuit = Circuit.CLOSED
            worker.circuit_failures = 0
            logger.info("worker %s: circuit closed; it takes turns again", worker.url)
        self._members.notify()
