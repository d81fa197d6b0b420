"""`WorkerPool`: one engine's workers, put together from the pool's parts.

Each concern has its module, and this class only builds them and says who
may call what:

- engines: `send` (the one path of a request: `dispatch`), `pin` (the
  worker a session's next request goes to, for engines that plan on it),
  `adopt` / `release_session`, worker-side sessions (`control`) and
  `server_info`;
- the rescorer: `scorer` (a worker to score on), then `send`;
- operators and the app: membership (`add`, `join`, `get`, `remove`, `workers`,
  `counts`), the served model (`served`, `model_info`), pauses
  (`interrupt`, `resume_sending`), `run` / `aclose`, and `wait_until` for
  tools and tests that wait on the pool's changes.

All bookkeeping (pins, counters, states) is synchronous code on the event
loop; background work (probes, closes) runs in the nursery of `run`.
"""

from __future__ import annotations

import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import httpx
import trio

from ...errors import InvalidRequest
from ..base import EngineSession, Validation
from .circuit import Breaker
from .control import Control
from .dialect import ModelInfo, WorkerDialect
from .dispatch import Dispatch, Sent, WorkerRequest
from .health import HealthChecks
from .interrupts import Interrupts
from .membership import Membership
from .options import PoolOptions
from .paused import Pauses
from .placement import Placer
from .worker import Worker

__all__ = ["WorkerPool"]

T = TypeVar("T")


class WorkerPool:
    def __init__(
        self,
        options: PoolOptions,
        validation: Validation,
        clock: Callable[[], float] = time.time,
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`validation` runs the checks of requests' 200 answers; `tls`
        verifies ``https`` workers (by default httpx's context, certifi's CA
        bundle), built once for every worker."""
        self._options = options
        # trust_env=False: probes reach a worker the way its traffic does
        # (`WorkerClient` never reads HTTP(S)_PROXY), so a proxy in the
        # environment cannot make a worker look dead, or alive, to one only.
        tls = tls if tls is not None else httpx.create_ssl_context(trust_env=False)
        # Probes and control calls: a small client of their own, so a
        # saturated traffic pool never makes a live worker look dead.
        self._probe_client = httpx.AsyncClient(
            trust_env=False,
            verify=tls,
            timeout=options.health_timeout_s,
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=16),
        )
        members = self._members = Membership(options, tls)
        control = self._control = Control(
            members,
            self._probe_client,
            session_hints=options.sends_session_hints,
            timeout_s=options.health_timeout_s,
        )
        health = self._health = HealthChecks(members, options, self._probe_client, clock)
        breaker = self._breaker = Breaker(members, options, health)
        placer = self._placer = Placer(members, options, moved=control.close_remote)
        interrupts = self._interrupts = Interrupts(members, options, self._probe_client, control)
        pauses = Pauses(members, options)
        self._dispatch = Dispatch(
            members, options, placer, breaker, health, interrupts, pauses, validation
        )

    # -- engines --------------------------------------------------------------------

    async def send(self, session: EngineSession, request: WorkerRequest[T]) -> Sent[T]:
        """One request for `session` (`dispatch.Dispatch.send`)."""
        return await self._dispatch.send(session, request)

    def pin(self, session: EngineSession) -> str:
        """Pin `session` (or keep its pin) now, before its request is built:
        the URL it goes to unless that worker fails first."""
        return self._placer.pin(session).url

    def adopt(self, session: EngineSession) -> None:
        """Count a session restored with its pin (journal replay)."""
        self._placer.adopt(session)

    def release_session(self, session: EngineSession) -> None:
        """The session is gone: unpin it and, with --kv-sessions hint, free
        its KV on its worker at once."""
        self._placer.release(session)

    def close_worker_session(self, url: str, remote_id: str) -> None:
        self._control.close_worker_session(url, remote_id)

    async def close_worker_sessions(self, pinned: list[tuple[str, str]]) -> None:
        await self._control.close_worker_sessions(pinned)

    async def close_remote_sessions(self, sessions: Iterable[EngineSession]) -> None:
        await self._control.close_remote_sessions(sessions)

    async def server_info(self, url: str) -> dict[str, Any]:
        return await self._health.server_info(url)

    @property
    def dialect(self) -> WorkerDialect:
        return self._options.dialect

    # -- the rescorer -----------------------------------------------------------

    def scorer(self, url: str | None, key: str) -> str:
        return self._placer.scorer(url, key)

    # -- membership and the served model ----------------------------------------

    @property
    def workers(self) -> dict[str, Worker]:
        """The members by URL, in the order they joined (read only)."""
        return self._members.workers

    def add(self, url: str) -> Worker:
        """A new worker, `JOINING`: checked at once, used once admitted."""
        worker = self._members.add(url)
        self._health.admit_soon(worker)
        return worker

    async def join(self, url: str) -> Worker:
        """A worker added at run time (``POST /workers``), checked now: one
        that answers but is not a worker this pool takes (another engine's,
        another model, other launch settings) is refused with the reason
        (`InvalidRequest`) and not kept; one that does not answer yet stays
        joining."""
        worker = self._members.add(url)
        refusal = await self._health.admit_now(worker)
        if refusal is not None:
            await self._members.remove(worker.url)
            raise InvalidRequest(f"worker {worker.url} cannot join: {refusal}", param="url")
        return worker

    def get(self, url: str) -> Worker:
        return self._members.get(url)

    def knows(self, url: str) -> bool:
        return self._members.knows(url)

    async def remove(self, url: str) -> Worker:
        return await self._members.remove(url)

    def counts(self) -> tuple[int, int]:
        return self._members.counts()

    @property
    def served(self) -> ModelInfo | None:
        """The served model, once a worker passed an admission check."""
        return self._health.served

    async def model_info(self) -> ModelInfo:
        return await self._health.model_info()

    @property
    def control_failures(self) -> Counter[str]:
        """Failed best-effort calls to workers, by call (the metric)."""
        return self._control.failures

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checked after every change of
        the pool — for operators' tools and tests, which must not poll."""
        await self._members.wait_until(predicate)

    async def wait_for_health(self, url: str, healthy: bool) -> None:
        """Return once the worker at `url` can (or cannot) take pins."""
        await self.wait_until(lambda: self.get(url).healthy is healthy)

    # -- pauses -----------------------------------------------------------------

    async def interrupt(self) -> int:
        return await self._interrupts.interrupt()

    def resume_sending(self) -> None:
        self._interrupts.resume_sending()

    # -- life -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Health rounds, circuit tests and background calls; runs until `aclose`."""
        async with trio.open_nursery() as nursery:
            self._members.nursery = nursery
            task_status.started()
            while True:
                await self._health.round()
                for worker in list(self._members.workers.values()):
                    self._breaker.test(worker)
                await trio.sleep(self._options.health_interval_s)

    async def aclose(self) -> None:
        nursery = self._members.nursery
        if nursery is not None:
            nursery.cancel_scope.cancel()
        await self._members.aclose()
        await self._probe_client.aclose()
