"""The worker pool: membership, health, sticky dispatch, failover
(docs/deploy.md#placement-and-health-flags).

Each worker has its own `WorkerClient` (keep-alive connections, at most
``upstream_max_connections`` in flight). Health probes use one separate small
httpx client, so a saturated traffic pool never makes a live worker look dead.

Health: a probe of ``GET /health`` every ``health_interval_s``;
``unhealthy_after`` consecutive failures (probes, or connection/transport
errors of real traffic) mark a worker unhealthy, ``healthy_after``
consecutive successful probes heal it. Timeouts of real traffic do not count:
a long generation is not a dead worker.

Failover: a session pinned to an unhealthy, draining or removed worker is
re-pinned on its next turn (every turn carries the full ``input_ids``, so only
the cache is cold). A connect error — nothing reached the worker — is retried
once on another eligible worker; anything after sending is not retried.

All bookkeeping (pins, counters, health flags) is synchronous code on the
event loop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from .config import Settings
from .errors import NoHealthyWorker, UpstreamError, WorkerExists, WorkerNotFound
from .placement import make_placement
from .sessions import Session
from .upstream import (
    ModelInfo,
    NotSent,
    UpstreamReply,
    WorkerClient,
    fetch_model_info,
    post_chat,
)

__all__ = ["Worker", "WorkerPool"]

logger = logging.getLogger("rollout_session")


@dataclass(eq=False)
class Worker:
    url: str
    client: WorkerClient
    healthy: bool = True
    # Draining: no new pins; removed once `inflight` reaches 0.
    draining: bool = False
    active_sessions: int = 0  # sessions pinned here
    inflight: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_checked_at: float | None = None
    idle: trio.Event = field(default_factory=trio.Event)

    def summary(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "active_sessions": self.active_sessions,
            "inflight": self.inflight,
            "consecutive_failures": self.consecutive_failures,
            "last_checked_at": self.last_checked_at,
        }


class WorkerPool:
    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self._settings = settings
        self._clock = clock
        self._placement = make_placement(settings.placement)
        self.workers: dict[str, Worker] = {}
        self._probe_client = httpx.AsyncClient(
            timeout=settings.health_timeout_s,
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=16),
        )
        self._nursery: trio.Nursery | None = None
        self._health_changed = trio.Event()

    # -- membership ------------------------------------------------------------

    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        if url in self.workers:
            raise WorkerExists(f"worker {url} is already in the pool")
        settings = self._settings
        client = WorkerClient(
            url,
            max_connections=settings.upstream_max_connections,
            timeout_s=settings.upstream_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
        )
        worker = self.workers[url] = Worker(url=url, client=client)
        return worker

    def get(self, url: str) -> Worker:
        worker = self.workers.get(url.rstrip("/"))
        if worker is None:
            raise WorkerNotFound(f"worker {url} is not in the pool")
        return worker

    async def remove(self, url: str) -> Worker:
        """Drain (no new pins, in-flight turns finish), then forget the worker."""
        worker = self.get(url)
        worker.draining = True
        if worker.inflight:
            await worker.idle.wait()
        if self.workers.get(worker.url) is worker:
            del self.workers[worker.url]
            await worker.client.aclose()
        return worker

    def counts(self) -> tuple[int, int]:
        return sum(w.healthy for w in self.workers.values()), len(self.workers)

    def _eligible(self, exclude: str | None = None) -> list[Worker]:
        return [
            w for w in self.workers.values() if w.healthy and not w.draining and w.url != exclude
        ]

    # -- dispatch ----------------------------------------------------------------

    def _pin(self, session: Session, exclude: str | None = None) -> Worker:
        candidates = self._eligible(exclude)
        if not candidates:
            retry = max(1, math.ceil(self._settings.health_interval_s))
            raise NoHealthyWorker("no healthy worker is available", retry_after_s=retry)
        chosen = self._placement.choose(session.id, session.worker, candidates)
        assert isinstance(chosen, Worker)
        if chosen.url != session.worker:
            previous = self.workers.get(session.worker) if session.worker else None
            if previous is not None:
                previous.active_sessions -= 1
                # Its KV there is dead weight now: the next turn prefills here.
                self._close_remote(previous, session.id)
            chosen.active_sessions += 1
            session.worker = chosen.url
        return chosen

    def adopt(self, session: Session) -> None:
        """Count a session restored with its pin (journal replay)."""
        worker = self.workers.get(session.worker) if session.worker else None
        if worker is not None:
            worker.active_sessions += 1

    def release_session(self, session: Session) -> None:
        """The session is gone: unpin it and, if enabled, free its KV at once.
        Idempotent: an expired session that is then collected is released once."""
        worker = self.workers.get(session.worker) if session.worker else None
        session.worker = None
        if worker is None:
            return
        worker.active_sessions -= 1
        self._close_remote(worker, session.id)

    def _close_remote(self, worker: Worker, session_id: str) -> None:
        """With --sglang-session-cache, free the session's KV on `worker` now
        rather than when SGLang evicts it."""
        if self._settings.sglang_session_cache and self._nursery is not None:
            self._nursery.start_soon(self._close_remote_session, worker, session_id)

    async def _close_remote_session(self, worker: Worker, session_id: str) -> None:
        # Best effort, in the background: a dead worker must not delay a DELETE
        # or a turn.
        try:
            await self._probe_client.post(
                f"{worker.url}/close_session", json={"session_id": session_id}
            )
        except httpx.HTTPError as exc:
            logger.info("close_session on %s failed: %s", worker.url, exc)

    async def _send(self, worker: Worker, session_id: str, payload: bytes) -> UpstreamReply:
        worker.inflight += 1
        try:
            reply = await post_chat(
                worker.client, session_id, payload, self._settings.upstream_timeout_s
            )
        except (NotSent, UpstreamError):
            # UpstreamTimeout is not caught here: slowness is not death.
            self._record(worker, ok=False)
            raise
        finally:
            worker.inflight -= 1
            if worker.inflight == 0:
                worker.idle.set()
                worker.idle = trio.Event()
        worker.consecutive_failures = 0
        return reply

    async def chat(self, session: Session, payload: bytes) -> UpstreamReply:
        """Send a turn to the session's worker (pinning or re-pinning it)."""
        worker = self._pin(session)
        try:
            return await self._send(worker, session.id, payload)
        except NotSent as first:
            # Nothing reached that worker: one retry elsewhere is safe.
            try:
                retry = self._pin(session, exclude=worker.url)
            except NoHealthyWorker:
                raise UpstreamError(str(first)) from None
            try:
                return await self._send(retry, session.id, payload)
            except NotSent as second:
                raise UpstreamError(str(second)) from None

    # -- health ----------------------------------------------------------------

    def _record(self, worker: Worker, *, ok: bool) -> None:
        settings = self._settings
        if ok:
            worker.consecutive_successes += 1
            worker.consecutive_failures = 0
            if not worker.healthy and worker.consecutive_successes >= settings.healthy_after:
                worker.healthy = True
                logger.info("worker %s is healthy again", worker.url)
                self._notify_health()
        else:
            worker.consecutive_failures += 1
            worker.consecutive_successes = 0
            if worker.healthy and worker.consecutive_failures >= settings.unhealthy_after:
                worker.healthy = False
                logger.warning("worker %s marked unhealthy", worker.url)
                self._notify_health()

    def _notify_health(self) -> None:
        self._health_changed.set()
        self._health_changed = trio.Event()

    async def wait_for_health(self, url: str, healthy: bool) -> None:
        """Return once the worker at `url` is (un)healthy — for operators' tools
        and tests, which must not poll."""
        while self.get(url).healthy is not healthy:
            await self._health_changed.wait()

    async def _probe(self, worker: Worker) -> None:
        try:
            with trio.fail_after(self._settings.health_timeout_s):
                response = await self._probe_client.get(f"{worker.url}/health")
            ok = response.status_code == 200
        except (httpx.HTTPError, trio.TooSlowError):
            ok = False
        worker.last_checked_at = self._clock()
        if self.workers.get(worker.url) is worker:
            self._record(worker, ok=ok)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Health checks and background calls; runs until `aclose`."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                async with trio.open_nursery() as probes:
                    for worker in list(self.workers.values()):
                        probes.start_soon(self._probe, worker)
                await trio.sleep(self._settings.health_interval_s)

    async def aclose(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        for worker in list(self.workers.values()):
            await worker.client.aclose()
        await self._probe_client.aclose()

    async def model_info(self) -> ModelInfo:
        """Model card of the first healthy worker."""
        eligible = self._eligible()
        if not eligible:
            raise NoHealthyWorker("no healthy worker to ask for its model")
        settings = self._settings
        # Two small GETs: a probe's budget each, plus connecting.
        deadline = settings.connect_timeout_s + 2 * settings.health_timeout_s
        return await fetch_model_info(eligible[0].client, deadline)
