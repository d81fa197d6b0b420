"""The worker pool: membership, admission, health, circuit breaking, sticky
dispatch, failover (docs/reliability.md#workers).

Each worker has its own `WorkerClient` (keep-alive connections, at most
``upstream_max_connections`` in flight). Health probes use one separate small
httpx client, so a saturated traffic pool never makes a live worker look dead.
Both verify an ``https`` worker with one TLS context, the pool's: building
one loads the CA bundle, which costs more CPU than a turn.

A worker takes pins only while it is healthy, its circuit closed and it is
not draining. Two independent judgements, each with its own state:

- **Health** (`Health`), from probes every ``health_interval_s``. A worker
  joins (configured or ``POST /workers``) as ``JOINING`` and is admitted
  once it passes an admission check: ``GET /health`` answers 200 and
  what it serves reads as its engine's worker (`dialect`: SGLang's
  ``/get_model_info`` + ``/v1/models``, vLLM's ``/v1/models``) for a
  generation model that lists the served model (the one learned from the
  first worker, in pool order, that passed). A healthy worker is probed with
  ``GET /health``: ``unhealthy_after`` failures in a row make it unhealthy;
  ``healthy_after`` admission checks in a row bring it back (a worker
  restarted with another model never comes back).
- **Circuit** (`Circuit`), from real traffic. ``circuit_failures`` failed
  turns in a row — transport errors, 5xx answers, answers over
  ``--max-answer-mb``, and answers that fail validation (the engine calls
  `report_failure`) — open it. A failure the worker *answered* (a 5xx, an
  oversize or invalid answer) may be the request's doing, not the worker's:
  one agent's hostile requests must not shut a worker off for every session.
  So when the count is reached by such a failure, the pool first sends its
  dialect's one-token chat probe: if the worker answers it, the failures are
  taken as the requests' (logged, the count starts over, the circuit stays
  closed); if not, the circuit opens. After ``circuit_open_s`` it is half-open:
  the pool itself sends its dialect's one-token probes (agents' turns never
  test a worker) until ``circuit_successes`` in a row close it or one failure
  reopens it. Timeouts and 4xx answers count neither way: a long generation
  is not a dead worker, and a 4xx is the request's fault.

Failover: a session pinned to a worker that cannot take pins is re-pinned on
its next turn (every turn carries the full ``input_ids``, so only the cache
is cold). A connect error — nothing reached the worker — is retried once on
another eligible worker; anything after sending is not retried.

All bookkeeping (pins, counters, states) is synchronous code on the event
loop.
"""

from __future__ import annotations

import enum
import logging
import math
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from ..errors import (
    InvalidRequest,
    NoHealthyWorker,
    UpstreamError,
    UpstreamMalformed,
    UpstreamTimeout,
    WorkerExists,
    WorkerNotFound,
)
from .base import EngineSession
from .dialect import SGLANG_WORKERS, WorkerDialect
from .placement import make_placement
from .upstream import (
    CHAT_PATH,
    PROBE_SESSION,
    ModelInfo,
    NotSent,
    UpstreamReply,
    WorkerClient,
    post_chat,
    transport_detail,
)
from .worker_urls import WorkerHosts, parse_worker_url, worker_url

__all__ = ["Circuit", "Health", "PoolOptions", "Worker", "WorkerPool"]

logger = logging.getLogger("rollout_session")


@dataclass(frozen=True, kw_only=True)
class PoolOptions:
    """What the pool follows, fixed for the app: built by `Settings.pool_options`,
    where the defaults are; each field is the flag of the same name
    (docs/reliability.md#workers)."""

    placement: str
    allowed_worker_hosts: WorkerHosts | None  # None = any host
    health_interval_s: float
    health_timeout_s: float
    unhealthy_after: int
    healthy_after: int
    circuit_failures: int
    circuit_successes: int
    circuit_open_s: float
    upstream_max_connections: int
    upstream_timeout_s: float
    connect_timeout_s: float
    max_answer_bytes: int
    sends_session_hints: bool  # --kv-sessions hint
    fixed_upstream_model: str | None  # --upstream-model NAME (not a keyword)
    dialect: WorkerDialect = SGLANG_WORKERS  # the workers' engine (--engine)
    # What the pool's log lines call it ("" for the rollout workers).
    label: str = ""


class Health(enum.Enum):
    # Added, never admitted: no pins until one admission check passes.
    JOINING = "joining"
    # Admitted, and its /health probes pass.
    HEALTHY = "healthy"
    # `unhealthy_after` /health probes failed in a row: no pins until
    # `healthy_after` admission checks in a row pass.
    UNHEALTHY = "unhealthy"


class Circuit(enum.Enum):
    # Turns flow; `circuit_failures` failed turns in a row open it.
    CLOSED = "closed"
    # No pins; half-open after `circuit_open_s`.
    OPEN = "open"
    # No pins; chat probes test the worker: `circuit_successes` in a row
    # close it, one failure reopens it.
    HALF_OPEN = "half_open"


@dataclass(eq=False)
class Worker:
    url: str
    client: WorkerClient
    health: Health = Health.JOINING
    circuit: Circuit = Circuit.CLOSED
    # Draining: no new pins; removed once `inflight` reaches 0.
    draining: bool = False
    active_sessions: int = 0  # sessions pinned here
    inflight: int = 0
    # Turn requests in flight here, by the id they were sent with: what a
    # pause in abort mode aborts.
    requests: set[str] = field(default_factory=set)
    # Probes (health and admission checks) in a row.
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # Failed turns in a row while closed; chat probes passed while half-open.
    circuit_failures: int = 0
    circuit_successes: int = 0
    circuit_opened_at: float = 0.0  # trio.current_time()
    # A chat probe is in flight: testing a half-open circuit, or confirming
    # that failed turns are the worker's before the circuit opens.
    chat_probing: bool = False
    # Times answered failures reached `circuit_failures` but the chat probe
    # passed: the requests' fault, not the worker's (circuit stays closed).
    circuit_excused: int = 0
    # The served model, once an admission check saw it listed.
    model: str | None = None
    # --kv-sessions hint: whether its /server_info says it honours session
    # ids (--enable-session-radix-cache); None = not asked (yet).
    session_hints: bool | None = None
    # Why the last probe or turn failed (operators only: it names the worker).
    last_error: str | None = None
    last_checked_at: float | None = None
    # Failed best-effort calls (POST /close_session), by call. Logged at the
    # first only, however often it fails (a gateway without the route fails
    # every one).
    control_failures: Counter[str] = field(default_factory=Counter)
    idle: trio.Event = field(default_factory=trio.Event)
    # Set once a drain removed it (None: no drain begun).
    removed: trio.Event | None = None

    @property
    def healthy(self) -> bool:
        """It may take pins (unless draining)."""
        return self.health is Health.HEALTHY and self.circuit is Circuit.CLOSED

    def summary(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "state": self.health.value,
            "circuit": self.circuit.value,
            "draining": self.draining,
            "model": self.model,
            "session_hints": self.session_hints,
            "active_sessions": self.active_sessions,
            "inflight": self.inflight,
            "consecutive_failures": self.consecutive_failures,
            "circuit_failures": self.circuit_failures,
            "circuit_excused": self.circuit_excused,
            "last_error": self.last_error,
            "last_checked_at": self.last_checked_at,
            "control_failures": dict(self.control_failures),
        }


class WorkerPool:
    def __init__(
        self,
        options: PoolOptions,
        clock: Callable[[], float] = time.time,
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls` verifies ``https`` workers; by default httpx's context
        (certifi's CA bundle), built here once for every worker."""
        self._options = options
        self._clock = clock
        self._placement = make_placement(options.placement)
        self._allowed_hosts = options.allowed_worker_hosts
        self.workers: dict[str, Worker] = {}
        # The served model: learned from the first worker that passed an
        # admission check; every worker must list it.
        self.served: ModelInfo | None = None
        # trust_env=False: probes reach a worker the way its traffic does
        # (`WorkerClient` never reads HTTP(S)_PROXY), so a proxy in the
        # environment cannot make a worker look dead, or alive, to one only.
        self._tls = tls if tls is not None else httpx.create_ssl_context(trust_env=False)
        self._probe_client = httpx.AsyncClient(
            trust_env=False,
            verify=self._tls,
            timeout=options.health_timeout_s,
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=16),
        )
        self._nursery: trio.Nursery | None = None
        # Best-effort control calls that failed, per call (logged once per worker).
        self.control_failures: Counter[str] = Counter()
        self._control_logged: set[tuple[str, str]] = set()
        # Workers whose /server_info was read for --kv-sessions hint (once each).
        self._hints_asked: set[str] = set()
        self._first_round = trio.Event()
        self._changed = trio.Event()
        # Cleared by `interrupt` (a pause in abort mode): no turn request is
        # sent until `resume_sending`.
        self._sending = trio.Event()
        self._sending.set()

    # -- membership ------------------------------------------------------------

    def add(self, url: str) -> Worker:
        """A new worker, `JOINING`: checked at once, used once admitted."""
        try:
            url = worker_url(url, self._allowed_hosts)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="url") from None
        if url in self.workers:
            raise WorkerExists(f"worker {url} is already in the pool")
        options = self._options
        client = WorkerClient(
            url,
            max_connections=options.upstream_max_connections,
            timeout_s=options.upstream_timeout_s,
            connect_timeout_s=options.connect_timeout_s,
            tls=self._tls,
        )
        worker = self.workers[url] = Worker(url=url, client=client)
        if self._nursery is not None and self.served is not None:
            # Before start-up learned the model, the first round admits it.
            self._nursery.start_soon(self._admit_one, worker)
        self._notify()
        return worker

    def get(self, url: str) -> Worker:
        try:
            key = parse_worker_url(url).url
        except ValueError:
            key = url.rstrip("/")
        worker = self.workers.get(key)
        if worker is None:
            raise WorkerNotFound(f"worker {url} is not in the pool")
        return worker

    async def remove(self, url: str) -> Worker:
        """Drain (no new pins, in-flight turns finish), then forget the worker.

        The drain runs in the pool, not in the caller: once begun it completes
        even if the caller goes away (a DELETE whose client gave up). A second
        call waits for the same drain."""
        worker = self.get(url)
        if worker.removed is None:
            worker.draining = True
            worker.removed = trio.Event()
            self._notify()
            if self._nursery is not None:
                self._nursery.start_soon(self._drain, worker)
            else:
                with trio.CancelScope(shield=True):
                    await self._drain(worker)
        await worker.removed.wait()
        return worker

    async def _drain(self, worker: Worker) -> None:
        while worker.inflight:
            await worker.idle.wait()
        if self.workers.get(worker.url) is worker:
            del self.workers[worker.url]
        await worker.client.aclose()
        assert worker.removed is not None
        worker.removed.set()
        self._notify()

    def counts(self) -> tuple[int, int]:
        return sum(w.healthy for w in self.workers.values()), len(self.workers)

    def _eligible(self, exclude: str | None = None) -> list[Worker]:
        return [
            w for w in self.workers.values() if w.healthy and not w.draining and w.url != exclude
        ]

    # -- dispatch ----------------------------------------------------------------

    @property
    def _retry_after_s(self) -> int:
        """When a request refused for want of a worker may try again: the
        next health round."""
        return max(1, math.ceil(self._options.health_interval_s))

    def _choose(self, key: str, current: str | None, exclude: str | None = None) -> Worker:
        """Placement's eligible worker for `key` (a session id), which is on
        `current` now; `NoHealthyWorker` when none is eligible."""
        candidates = self._eligible(exclude)
        if not candidates:
            raise NoHealthyWorker(
                "no healthy worker is available", retry_after_s=self._retry_after_s
            )
        chosen = self._placement.choose(key, current, candidates)
        assert isinstance(chosen, Worker)
        return chosen

    def _pin(self, session: EngineSession, exclude: str | None = None) -> Worker:
        chosen = self._choose(session.id, session.worker, exclude)
        if chosen.url != session.worker:
            previous = self.workers.get(session.worker) if session.worker else None
            if previous is not None:
                previous.active_sessions -= 1
                # Its KV there is dead weight now: the next turn prefills here.
                self._close_remote(previous, session.id)
            chosen.active_sessions += 1
            session.worker = chosen.url
        return chosen

    async def server_info(self, url: str) -> dict[str, Any]:
        """The worker's ``/server_info`` (SGLang's server args), or {} when it
        cannot be read (a gateway in front, an older worker)."""
        try:
            response = await self._probe_client.get(f"{url}/server_info")
            data = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        return data if isinstance(data, dict) else {}

    def pin(self, session: EngineSession) -> str:
        """Pin `session` (or keep its pin) now, before its turn is sent: the
        URL its next request goes to unless that worker fails first."""
        return self._pin(session).url

    def adopt(self, session: EngineSession) -> None:
        """Count a session restored with its pin (journal replay)."""
        worker = self.workers.get(session.worker) if session.worker else None
        if worker is not None:
            worker.active_sessions += 1

    def release_session(self, session: EngineSession) -> None:
        """The session is gone: unpin it and, if enabled, free its KV at once.
        Idempotent: an expired session that is then collected is released once."""
        worker = self.workers.get(session.worker) if session.worker else None
        session.worker = None
        if worker is None:
            return
        worker.active_sessions -= 1
        self._close_remote(worker, session.id)

    def _close_remote(self, worker: Worker, session_id: str) -> None:
        """With --kv-sessions hint, drop the session's reference to its KV on
        `worker` now (in the background), so SGLang may evict it first."""
        if self._options.sends_session_hints and self._nursery is not None:
            self._nursery.start_soon(self._close_remote_session, worker.url, session_id)

    async def _close_remote_session(self, url: str, session_id: str) -> None:
        # Best effort, in the background: a dead worker must not delay a DELETE
        # or a turn. The answer's body is never read.
        call = "POST /close_session"
        try:
            async with self._probe_client.stream(
                "POST", f"{url}/close_session", json={"session_id": session_id}
            ) as response:
                status = response.status_code
        except httpx.HTTPError as exc:
            self._control_failed(url, call, transport_detail(exc))
            return
        if not 200 <= status < 300:
            self._control_failed(url, call, f"answered {status}")

    async def close_remote_sessions(self, sessions: Iterable[EngineSession]) -> None:
        """Server shutdown, with --kv-sessions hint: close every session's
        worker-side session now, concurrently and within the health timeout
        (best effort: what is left stays referenced until the worker evicts it)."""
        if not self._options.sends_session_hints:
            return
        await self.close_worker_sessions([(s.worker, s.id) for s in sessions if s.worker])

    def close_worker_session(self, url: str, remote_id: str) -> None:
        """Close the worker-side session `remote_id` on `url` (in the
        background, best effort: a dead worker must not delay a turn)."""
        if self._nursery is not None:
            self._nursery.start_soon(self._close_remote_session, url, remote_id)

    async def close_worker_sessions(self, pinned: list[tuple[str, str]]) -> None:
        """Close these (worker URL, worker-side session id) pairs now,
        concurrently and within the health timeout (shutdown)."""
        if not pinned:
            return
        with trio.move_on_after(self._options.health_timeout_s) as scope:
            scope.shield = True
            async with trio.open_nursery() as nursery:
                for url, session_id in pinned:
                    nursery.start_soon(self._close_remote_session, url, session_id)
        if scope.cancelled_caught:
            logger.warning("shutdown: not every one of %d worker sessions closed", len(pinned))
        else:
            logger.info("shutdown: closed %d worker sessions", len(pinned))

    def _check_hint_support(self, worker: Worker) -> None:
        """With --kv-sessions hint, warn (once per worker) when the worker
        does not say it runs --enable-session-radix-cache: without it SGLang
        ignores the hints, and nothing else would tell the operator."""
        if not self._options.sends_session_hints or worker.url in self._hints_asked:
            return
        self._hints_asked.add(worker.url)
        if self._nursery is not None:
            self._nursery.start_soon(self._read_hint_support, worker)

    async def _read_hint_support(self, worker: Worker) -> None:
        url = worker.url
        try:
            response = await self._probe_client.get(f"{url}/server_info")
            enabled = response.status_code == 200 and (
                response.json().get("enable_session_radix_cache") is True
            )
        except (httpx.HTTPError, ValueError, AttributeError):
            enabled = False
        worker.session_hints = enabled
        self._notify()
        if not enabled:
            logger.warning(
                "--kv-sessions hint: worker %s does not report enable_session_radix_cache "
                "in /server_info; SGLang ignores session ids unless it runs with "
                "--enable-session-radix-cache (docs/kv-sessions.md)",
                url,
            )

    def _control_failed(self, url: str, call: str, detail: str) -> None:
        """A best-effort call to a worker failed: ignored, but never silently.
        Counted (per worker in `GET /workers`, in total in
        rollout_control_failures_total) and logged once per worker and call:
        a dead worker would otherwise log once per session."""
        self.control_failures[call] += 1
        worker = self.workers.get(url)
        if worker is not None:
            worker.control_failures[call] += 1
        self._notify()
        if (url, call) in self._control_logged:
            return
        self._control_logged.add((url, call))
        logger.warning(
            "worker %s: %s failed (%s); ignored (best effort), and further failures of "
            "it on this worker are only counted. Behind a gateway without the route "
            "(smg), --kv-sessions hint releases no KV: SGLang evicts it itself",
            url,
            call,
            detail,
        )

    async def _send(
        self,
        worker: Worker,
        session_id: str,
        payload: bytes,
        path: str = CHAT_PATH,
        request_id: str | None = None,
    ) -> UpstreamReply:
        options = self._options
        worker.inflight += 1
        if request_id is not None:
            worker.requests.add(request_id)
        try:
            reply = await post_chat(
                worker.client,
                session_id,
                payload,
                options.upstream_timeout_s,
                options.max_answer_bytes,
                path,
                options.dialect.session_headers,
            )
        except (NotSent, UpstreamError) as exc:
            # UpstreamTimeout is not caught here: slowness is not death.
            self._turn_failed(worker, str(exc), answered=False)
            raise
        except UpstreamMalformed as exc:  # an answer over --max-answer-mb
            self._turn_failed(worker, str(exc), answered=True)
            raise
        finally:
            worker.inflight -= 1
            worker.requests.discard(request_id or "")
            if worker.inflight == 0:
                worker.idle.set()
                worker.idle = trio.Event()
        if reply.status >= 500:
            logger.info("worker %s answered a turn with %d", worker.url, reply.status)
            self._turn_failed(worker, f"answered a turn with {reply.status}", answered=True)
        # A 200 counts once validated: the engine reports it.
        return reply

    async def chat(
        self,
        session: EngineSession,
        payload: bytes,
        path: str = CHAT_PATH,
        request_id: str | None = None,
        *,
        resend_if_gone: bool = False,
    ) -> UpstreamReply:
        """Send a turn to the session's worker (pinning or re-pinning it), on
        SGLang's chat route unless `path` names another (``/generate``).
        `request_id` (the id the body gives the request) makes it abortable
        by `interrupt`. While interrupted, it waits for `resume_sending`.
        `resend_if_gone` (a continuation, which holds sampled work): after a
        transport error once sent, a worker whose ``/health`` fails too is
        gone, and whatever it did with it; the request goes to another.

        A 200 is neither a success nor a failure of the worker until the
        engine has validated it: it then calls `report_success` or
        `report_failure` with ``reply.worker``."""
        await self._sending.wait()
        worker = self._pin(session)
        try:
            return await self._send(worker, session.id, payload, path, request_id)
        except NotSent as not_sent:
            first: Exception = not_sent  # nothing reached that worker: a retry is safe
        except UpstreamError as lost:
            gone = await self._health_failure(worker) if resend_if_gone else None
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
            retry = self._pin(session, exclude=worker.url)
        except NoHealthyWorker:
            raise UpstreamError(str(first)) from None
        try:
            return await self._send(retry, session.id, payload, path, request_id)
        except NotSent as second:
            raise UpstreamError(str(second)) from None

    @property
    def dialect(self) -> WorkerDialect:
        return self._options.dialect

    def knows(self, url: str) -> bool:
        """Whether `url` names a worker of this pool."""
        try:
            self.get(url)
        except WorkerNotFound:
            return False
        return True

    def scorer(self, url: str | None, key: str) -> str:
        """The worker a scoring request (a rescore) goes to: `url`, which must
        be this pool's and able to take requests, or with None one chosen by
        placement for `key` (a session id). Pins nothing: a teacher pool's
        choice must not move a session's rollouts."""
        if url is not None:
            worker = self.get(url)
            if not worker.healthy or worker.draining:
                raise NoHealthyWorker(
                    f"worker {worker.url} cannot take requests now "
                    f"({worker.health.value}, circuit {worker.circuit.value}"
                    f"{', draining' if worker.draining else ''})",
                    retry_after_s=self._retry_after_s,
                )
            return worker.url
        return self._choose(key, None).url

    async def score(self, url: str, key: str, payload: bytes) -> UpstreamReply:
        """Send a scoring request to the worker at `url` (`scorer`'s
        choice): no re-pin, no retry. Like a turn, a 200 counts for the
        worker once the caller validated it (`report_success`/`report_failure`)."""
        worker = self.get(url)
        return await self._send(worker, key, payload, self._options.dialect.scoring.path)

    async def follow_up(
        self, url: str, session: EngineSession, path: str, payload: bytes
    ) -> UpstreamReply:
        """A request that belongs to a turn the worker at `url` just answered
        (SGLang's parse routes): to that worker, no re-pin, no retry."""
        worker = self.workers.get(url)
        if worker is None:
            raise UpstreamError(f"worker {url} left the pool during the turn")
        return await self._send(worker, session.id, payload, path)

    # -- interrupting turns (a pause in abort mode) -------------------------------

    async def interrupt(self) -> int:
        """Hold every turn request not yet sent until `resume_sending`, and
        ask each worker to abort the ones it has (the dialect's route); each
        then answers `abort` with what it had sampled. Returns how many were
        asked. A worker that cannot be reached is logged and skipped: its
        requests finish (or fail) as they would have."""
        if self._sending.is_set():
            self._sending = trio.Event()
        asked = [(w, sorted(w.requests)) for w in self.workers.values() if w.requests]
        async with trio.open_nursery() as nursery:
            for worker, ids in asked:
                for path, body in self._options.dialect.abort_requests(ids):
                    nursery.start_soon(self._abort, worker, path, body)
        return sum(len(ids) for _, ids in asked)

    def resume_sending(self) -> None:
        self._sending.set()

    async def _abort(self, worker: Worker, path: str, body: bytes) -> None:
        # The probe client: the turn client's connections may all be held by
        # the very requests being aborted.
        try:
            response = await self._probe_client.post(
                worker.url + path, content=body, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            problem = transport_detail(exc)
        else:
            if response.status_code == 200:
                return
            problem = f"answered {response.status_code}: {response.text[:200]}"
        self.control_failures[path] += 1
        worker.control_failures[path] += 1
        logger.warning(
            "worker %s: %s failed (%s); its turns in flight were not interrupted and "
            "finish as they would have",
            worker.url,
            path,
            problem,
        )

    # -- circuit breaker ---------------------------------------------------------

    def report_success(self, url: str) -> None:
        """The worker at `url` answered a turn with a valid 200."""
        worker = self.workers.get(url)
        if worker is not None and worker.circuit is Circuit.CLOSED:
            worker.circuit_failures = 0

    def report_failure(self, url: str, reason: str) -> None:
        """The worker at `url` answered a turn with a 200 that failed
        validation (`reason`: what failed)."""
        worker = self.workers.get(url)
        if worker is not None:
            self._turn_failed(worker, reason, answered=True)

    def _turn_failed(self, worker: Worker, reason: str, *, answered: bool) -> None:
        """A turn failed at `worker`; `answered`: the worker answered (a
        5xx, an oversize or invalid answer), which the request may have
        caused, rather than the connection failing."""
        worker.last_error = f"turn: {reason}"
        if worker.circuit is not Circuit.CLOSED:
            return  # a turn sent before the circuit opened
        worker.circuit_failures += 1
        if worker.circuit_failures < self._options.circuit_failures:
            return
        if not answered or not self._start_chat_probe(worker, self._confirm_failures):
            self._open_circuit(worker)

    def _open_circuit(self, worker: Worker) -> None:
        worker.circuit = Circuit.OPEN
        worker.circuit_opened_at = trio.current_time()
        worker.circuit_successes = 0
        logger.warning(
            "worker %s: circuit open (%s); no new turns for %g s",
            worker.url,
            worker.last_error,
            self._options.circuit_open_s,
        )
        self._notify()

    def _test_circuit(self, worker: Worker) -> None:
        """Open long enough → half-open; half-open → one chat probe at a time."""
        if (
            worker.circuit is Circuit.OPEN
            and trio.current_time() - worker.circuit_opened_at >= self._options.circuit_open_s
        ):
            worker.circuit = Circuit.HALF_OPEN
            worker.circuit_successes = 0
            logger.info("worker %s: circuit half-open; probing its chat route", worker.url)
            self._notify()
        if worker.circuit is Circuit.HALF_OPEN and worker.health is Health.HEALTHY:
            self._start_chat_probe(worker, self._half_open_probed)

    def _start_chat_probe(self, worker: Worker, then: Callable[[Worker, str | None], None]) -> bool:
        """Send `worker` one chat probe unless one is in flight, then call
        `then` with the failure (None: it passed); False when it cannot be
        sent (the pool is not running, or has seen no served model yet)."""
        if worker.chat_probing:
            return True
        if self.served is None or self._nursery is None:
            return False
        worker.chat_probing = True
        model = self._options.fixed_upstream_model or self.served.model
        self._nursery.start_soon(self._probe_chat, worker, model, then)
        return True

    async def _probe_chat(
        self, worker: Worker, model: str, then: Callable[[Worker, str | None], None]
    ) -> None:
        reason: str | None = None
        try:
            reason = await self._chat_probe_failure(worker, model)
        finally:
            worker.chat_probing = False
        if self.workers.get(worker.url) is worker:
            then(worker, reason)

    def _confirm_failures(self, worker: Worker, reason: str | None) -> None:
        """The probe sent when answered failures reached the count."""
        if worker.circuit is not Circuit.CLOSED:
            return
        if reason is not None:
            worker.last_error = f"{worker.last_error}; {reason}"
            self._open_circuit(worker)
            return
        worker.circuit_excused += 1
        logger.warning(
            "worker %s: %d failed turns in a row (last: %s), but it answers a chat "
            "probe: taken as the requests' fault; its circuit stays closed",
            worker.url,
            worker.circuit_failures,
            worker.last_error,
        )
        worker.circuit_failures = 0
        self._notify()

    async def _chat_probe_failure(self, worker: Worker, model: str) -> str | None:
        """Why the dialect's one-token chat probe failed, or None."""
        options = self._options
        reason: str | None = None
        try:
            reply = await post_chat(
                worker.client,
                PROBE_SESSION,
                options.dialect.probe_body(model),
                options.upstream_timeout_s,
                options.max_answer_bytes,
                options.dialect.probe_path,
                options.dialect.session_headers,
            )
            if reply.status != 200:
                reason = f"chat probe answered {reply.status}"
            else:
                options.dialect.check_probe(reply.body)
        except (NotSent, UpstreamError, UpstreamMalformed, UpstreamTimeout) as exc:
            reason = f"chat probe: {exc}"
        return reason

    def _half_open_probed(self, worker: Worker, reason: str | None) -> None:
        options = self._options
        if worker.circuit is not Circuit.HALF_OPEN:
            return
        if reason is not None:
            worker.last_error = reason
            self._open_circuit(worker)
            return
        worker.circuit_successes += 1
        if worker.circuit_successes >= options.circuit_successes:
            worker.circuit = Circuit.CLOSED
            worker.circuit_failures = 0
            logger.info("worker %s: circuit closed; it takes turns again", worker.url)
        self._notify()

    # -- health ----------------------------------------------------------------

    def _record(self, worker: Worker, *, ok: bool, reason: str | None = None) -> None:
        """One probe's outcome: a /health probe of a healthy worker, or an
        admission check of any other."""
        options = self._options
        if ok:
            worker.consecutive_successes += 1
            worker.consecutive_failures = 0
            if worker.health is Health.JOINING or (
                worker.health is Health.UNHEALTHY
                and worker.consecutive_successes >= options.healthy_after
            ):
                joined = worker.health is Health.JOINING
                worker.health = Health.HEALTHY
                logger.info(
                    "worker %s %s (serves %s)",
                    worker.url,
                    "admitted" if joined else "is healthy again",
                    worker.model,
                )
        else:
            worker.consecutive_failures += 1
            worker.consecutive_successes = 0
            if reason != worker.last_error:
                logger.warning("worker %s: %s", worker.url, reason)
            worker.last_error = reason
            if (
                worker.health is Health.HEALTHY
                and worker.consecutive_failures >= options.unhealthy_after
            ):
                worker.health = Health.UNHEALTHY
                logger.warning("worker %s marked unhealthy", worker.url)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checked after every change of
        the pool (probe, state, membership) — for operators' tools and tests,
        which must not poll."""
        while not predicate():
            await self._changed.wait()

    async def wait_for_health(self, url: str, healthy: bool) -> None:
        """Return once the worker at `url` can (or cannot) take pins."""
        await self.wait_until(lambda: self.get(url).healthy is healthy)

    async def _health_failure(self, worker: Worker) -> str | None:
        """Why `GET /health` failed (logged when it changes: `_record`), None
        when it answered 200."""
        timeout = self._options.health_timeout_s
        try:
            with trio.fail_after(timeout):
                # The status is the answer; a body is never read.
                async with self._probe_client.stream("GET", f"{worker.url}/health") as response:
                    status = response.status_code
        except trio.TooSlowError:
            return f"GET /health: no answer within {timeout:g} s"
        except httpx.HTTPError as exc:
            return f"GET /health: {transport_detail(exc)}"
        return None if status == 200 else f"GET /health answered {status}"

    async def _probe(self, worker: Worker) -> None:
        reason = await self._health_failure(worker)
        worker.last_checked_at = self._clock()
        if self.workers.get(worker.url) is worker:
            self._record(worker, ok=reason is None, reason=reason)

    async def _check(self, worker: Worker, found: dict[Worker, ModelInfo | str]) -> None:
        """An admission check: /health, then what the worker serves (into
        `found`: its model card, or why it is not an SGLang worker)."""
        options = self._options
        failure = await self._health_failure(worker)
        if failure is not None:
            found[worker] = failure
        else:
            # Two small GETs: a probe's budget each, plus connecting.
            deadline = options.connect_timeout_s + 2 * options.health_timeout_s
            try:
                found[worker] = await options.dialect.read_model(worker.client, deadline)
            except UpstreamError as exc:
                found[worker] = str(exc)
        worker.last_checked_at = self._clock()

    def _admit(self, found: dict[Worker, ModelInfo | str]) -> None:
        """Record admission checks: a worker passes if it lists the served
        model (learned here, in pool order, when not yet known)."""
        if self.served is None:
            for worker in self.workers.values():
                card = found.get(worker)
                if isinstance(card, ModelInfo):
                    self.served = card
                    logger.info(
                        "%sserving model %s (as %s reports it)",
                        self._options.label,
                        card.model,
                        worker.url,
                    )
                    break
        for worker, card in found.items():
            if self.workers.get(worker.url) is not worker:
                continue
            if not isinstance(card, ModelInfo):
                self._record(worker, ok=False, reason=card)
            elif self.served is not None and self.served.model in card.models:
                worker.model = self.served.model
                self._record(worker, ok=True)
                self._check_hint_support(worker)
            else:
                served = self.served.model if self.served else "?"
                listed = ", ".join(card.models)
                self._record(worker, ok=False, reason=f"serves {listed}, not {served}")

    async def _admit_one(self, worker: Worker) -> None:
        found: dict[Worker, ModelInfo | str] = {}
        await self._check(worker, found)
        self._admit(found)

    async def _round(self) -> None:
        found: dict[Worker, ModelInfo | str] = {}
        async with trio.open_nursery() as probes:
            for worker in list(self.workers.values()):
                if worker.health is Health.HEALTHY:
                    probes.start_soon(self._probe, worker)
                else:
                    probes.start_soon(self._check, worker, found)
        self._admit(found)
        for worker in list(self.workers.values()):
            self._test_circuit(worker)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Health checks and background calls; runs until `aclose`."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await self._round()
                self._first_round.set()
                await trio.sleep(self._options.health_interval_s)

    async def aclose(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        for worker in list(self.workers.values()):
            await worker.client.aclose()
        await self._probe_client.aclose()

    async def model_info(self) -> ModelInfo:
        """The served model's card, once a worker passed an admission check
        (after the first round of checks when the pool runs)."""
        if self.served is None and self._nursery is not None:
            await self._first_round.wait()
        if self.served is None:
            raise NoHealthyWorker(
                "no worker has answered as an SGLang worker yet",
                retry_after_s=self._retry_after_s,
            )
        return self.served
