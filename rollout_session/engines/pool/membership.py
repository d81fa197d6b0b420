"""Which workers are in the pool: joining (``--worker``, ``POST /workers``),
draining and leaving (``DELETE /workers``), and the pool's change signal.

`Membership` is the one owner of the ``url → Worker`` table, in the order
the workers joined (placement breaks ties by it). Every change of the pool
(a probe, a state, a member) is announced through `notify`, so operators'
tools and tests wait on events (`wait_until`), never on a sleep. The pool's
background tasks run in the nursery it lends (`start_soon`).
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ...errors import InvalidRequest, WorkerExists, WorkerNotFound
from ..worker_urls import parse_worker_url, worker_url
from .client import WorkerClient
from .options import PoolOptions
from .worker import Worker

__all__ = ["Membership"]


class Membership:
    def __init__(self, options: PoolOptions, tls: ssl.SSLContext) -> None:
        self._options = options
        # One context for every worker: building one loads the CA bundle,
        # which costs more CPU than a turn.
        self._tls = tls
        self.workers: dict[str, Worker] = {}
        self._changed = trio.Event()
        # The pool's background nursery while it runs (`WorkerPool.run`).
        self.nursery: trio.Nursery | None = None

    # -- who is in ----------------------------------------------------------------

    def add(self, url: str) -> Worker:
        """A new worker, `JOINING` (the health checks admit it)."""
        try:
            url = worker_url(url, self._options.allowed_worker_hosts)
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
        self.notify()
        return worker

    def get(self, url: str) -> Worker:
        """The member at `url` (spelt any way `worker_url` accepts), or `WorkerNotFound`."""
        try:
            key = parse_worker_url(url).url
        except ValueError:
            key = url.rstrip("/")
        worker = self.workers.get(key)
        if worker is None:
            raise WorkerNotFound(f"worker {url} is not in the pool")
        return worker

    def knows(self, url: str) -> bool:
        """Whether `url` names a member."""
        try:
            self.get(url)
        except WorkerNotFound:
            return False
        return True

    def member(self, worker: Worker) -> bool:
        """Whether `worker` is still in (not removed, nor replaced under its URL)."""
        return self.workers.get(worker.url) is worker

    def counts(self) -> tuple[int, int]:
        """(healthy, all) members."""
        return sum(w.healthy for w in self.workers.values()), len(self.workers)

    def eligible(self, exclude: str | None = None) -> list[Worker]:
        """Members that may take a new pin, in pool order (but `exclude`)."""
        return [w for w in self.workers.values() if w.eligible and w.url != exclude]

    # -- leaving ------------------------------------------------------------------

    async def remove(self, url: str) -> Worker:
        """Drain (no new pins, requests in flight finish), then forget the worker.

        The drain runs in the pool's nursery, not in the caller: once begun
        it completes even if the caller goes away (a DELETE whose client
        gave up). A second call waits for the same drain."""
        worker = self.get(url)
        if worker.removed is None:
            worker.draining = True
            worker.removed = trio.Event()
            self.notify()
            if not self.start_soon(self._drain, worker):
                with trio.CancelScope(shield=True):
                    await self._drain(worker)
        await worker.removed.wait()
        return worker

    async def _drain(self, worker: Worker) -> None:
        while worker.inflight:
            await worker.idle.wait()
        if self.member(worker):
            del self.workers[worker.url]
        await worker.client.aclose()
        assert worker.removed is not None
        worker.removed.set()
        self.notify()

    async def aclose(self) -> None:
        for worker in list(self.workers.values()):
            await worker.client.aclose()

    # -- changes and background work ----------------------------------------------

    def notify(self) -> None:
        """Something about the pool changed: wake every `wait_until`."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checked after every change of
        the pool (probe, state, membership)."""
        while not predicate():
            await self._changed.wait()

    def start_soon(self, task: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Run `task(*args)` in the pool's background; False when the pool is
        not running (the caller then does without, or does it itself)."""
        if self.nursery is None:
            return False
        self.nursery.start_soon(task, *args)
        return True
