"""Placement policies: which worker serves a session's next turn.

One interface, three policies (``--placement``):

- ``sticky-least-loaded`` (default): keep the pinned worker while it is
  eligible; otherwise pin to the eligible worker with the fewest pinned
  sessions, ties broken by fewest in-flight requests, then by pool order.
- ``consistent-hash``: a hash ring over the eligible workers (virtual nodes);
  a session maps to the same worker while the pool is stable, and a pool
  change moves only ~1/N of the sessions.
- ``round-robin``: no affinity at all; the baseline for comparison.

Policies are pure: they choose among the candidates they are given and never
change worker state (the pool does the pin bookkeeping).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Sequence
from typing import Final, Protocol

__all__ = [
    "PLACEMENTS",
    "ConsistentHash",
    "Placement",
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
