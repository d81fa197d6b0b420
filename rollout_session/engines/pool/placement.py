"""Placement: which worker serves a session's next turn, and the pins.

One interface, three policies (``--placement``):

- ``sticky-least-loaded`` (default): keep the pinned worker while it is
  eligible; otherwise pin to the eligible worker with the fewest pinned
  sessions, ties broken by fewest in-flight requests, then by pool order.
- ``consistent-hash``: a hash ring over the eligible workers (virtual nodes);
  a session maps to the same worker while the pool is stable, and a pool
  change moves only ~1/N of the sessions.
- ``round-robin``: no affinity at all; the baseline for comparison.

Policies are pure: they choose among the candidates they are given and never
change worker state. `Placer` does the pin bookkeeping: a session is pinned
on its first request, re-pinned when its worker cannot take pins (every
request carries the whole prompt, so only the cache is cold), counted on
its worker while pinned, and unpinned when it ends.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Callable, Sequence
from typing import Final, Protocol

from ...errors import NoHealthyWorker
from ..base import EngineSession
from .membership import Membership
from .options import PoolOptions
from .worker import Worker

__all__ = [
    "PLACEMENTS",
    "ConsistentHash",
    "Placement",
    "Placer",
    "RoundRobin",
    "StickyLeastLoaded",
    "WorkerLoad",
    "make_placement",
]


class WorkerLoad(Protocol):
    """What a policy may read of a worker."""

    @property
    def url(self) -> str: ...

    @property
    def active_sessions(self) -> int: ...

    @property
    def inflight(self) -> int: ...


class Placement(Protocol):
    def choose(
        self, session_id: str, pinned: str | None, candidates: Sequence[WorkerLoad]
    ) -> WorkerLoad:
        """Pick one of `candidates` (non-empty, in pool order, all eligible)."""
        ...


class StickyLeastLoaded:
    def choose(
        self, session_id: str, pinned: str | None, candidates: Sequence[WorkerLoad]
    ) -> WorkerLoad:
        for worker in candidates:
            if worker.url == pinned:
                return worker
        # min() keeps the first of equals: ties fall back to pool order.
        return min(candidates, key=lambda w: (w.active_sessions, w.inflight))


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ConsistentHash:
    # Virtual nodes per worker: enough that load spreads within a few percent.
    REPLICAS: Final = 160

    def __init__(self) -> None:
        self._members: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _rebuild(self, urls: tuple[str, ...]) -> None:
        ring = sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(self.REPLICAS))
        self._members = urls
        self._points = [point for point, _ in ring]
        self._owners = [url for _, url in ring]

    def choose(
        self, session_id: str, pinned: str | None, candidates: Sequence[WorkerLoad]
    ) -> WorkerLoad:
        urls = tuple(sorted(w.url for w in candidates))
        if urls != self._members:
            self._rebuild(urls)
        at = bisect.bisect(self._points, _hash(session_id)) % len(self._points)
        owner = self._owners[at]
        return next(w for w in candidates if w.url == owner)


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(
        self, session_id: str, pinned: str | None, candidates: Sequence[WorkerLoad]
    ) -> WorkerLoad:
        return candidates[next(self._counter) % len(candidates)]


PLACEMENTS: Final = ("sticky-least-loaded", "consistent-hash", "round-robin")


def make_placement(name: str) -> Placement:
    if name == "sticky-least-loaded":
        return StickyLeastLoaded()
    if name == "consistent-hash":
        return ConsistentHash()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown placement {name!r}; one of {', '.join(PLACEMENTS)}")


class Placer:
    def __init__(
        self,
        members: Membership,
        options: PoolOptions,
        moved: Callable[[str, str], None],
    ) -> None:
        self._members = members
        self._options = options
        self._policy = make_placement(options.placement)
        # Called with (worker URL, session id) when a session leaves a worker
        # it was pinned to: its KV there is dead weight now.
        self._moved = moved

    def no_worker(self, message: str = "no healthy worker is available") -> NoHealthyWorker:
        """The error for want of a worker, with the next health round as Retry-After."""
        return NoHealthyWorker(message, retry_after_s=self._options.retry_after_s)

    def choose(self, key: str, current: str | None, exclude: str | None = None) -> Worker:
        """The policy's eligible worker for `key` (a session id), which is on
        `current` now; `NoHealthyWorker` when none is eligible."""
        candidates = self._members.eligible(exclude)
        if not candidates:
            raise self.no_worker()
        chosen = self._policy.choose(key, current, candidates)
        assert isinstance(chosen, Worker)
        return chosen

    def pin(self, session: EngineSession, exclude: str | None = None) -> Worker:
        """Pin `session` (or keep its pin): the worker its next request goes to."""
        chosen = self.choose(session.id, session.worker, exclude)
        if chosen.url != session.worker:
            previous = self._members.workers.get(session.worker) if session.worker else None
            if previous is not None:
                previous.active_sessions -= 1
                self._moved(previous.url, session.id)
            chosen.active_sessions += 1
            session.worker = chosen.url
        return chosen

    def adopt(self, session: EngineSession) -> None:
        """Count a session restored with its pin (journal replay)."""
        worker = self._members.workers.get(session.worker) if session.worker else None
        if worker is not None:
            worker.active_sessions += 1

    def release(self, session: EngineSession) -> None:
        """The session is gone: unpin it. Idempotent: an expired session
        that is then collected is released once."""
        worker = self._members.workers.get(session.worker) if session.worker else None
        session.worker = None
        if worker is not None:
            worker.active_sessions -= 1
            self._moved(worker.url, session.id)

    def scorer(self, url: str | None, key: str) -> str:
        """The worker a scoring request (a rescore) goes to: `url`, which must
        be a member able to take requests, or with None one chosen by the
        policy for `key` (a session id). Pins nothing: a teacher pool's
        choice must not move a session's rollouts."""
        if url is None:
            return self.choose(key, None).url
        worker = self._members.get(url)
        if not worker.eligible:
            raise self.no_worker(
                f"worker {worker.url} cannot take requests now "
                f"({worker.health.value}, circuit {worker.circuit.value}"
                f"{', draining' if worker.draining else ''})"
            )
        return worker.url
