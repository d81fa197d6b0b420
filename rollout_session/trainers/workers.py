"""The trainer's inference servers as the session servers' workers.

A trainer launches its own SGLang or vLLM servers, and may add or drop
replicas while it trains. `WorkerSync.sync` makes the session servers' pools
follow: a server the trainer lists is added (``POST /workers``: admitted
once it answers as the engine's worker, refused with the reason when it is
not one the pool takes), one it no longer lists is drained and removed. The
session servers must be started with the engine those servers run
(docs/trainers.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import anyio

from ..client import SessionClient

__all__ = ["WorkerSync", "worker_url"]

logger = logging.getLogger("rollout_session.trainers")


def worker_url(address: str) -> str:
    """A trainer's server address (``host:port``, or a URL) as a worker URL."""
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"


class WorkerSync:
    """One process's view of which workers it registered (a trainer builds an
    adapter per episode; they share this, so each server is added once)."""

    def __init__(
        self, client: SessionClient, *, api_key: str | None = None, every_s: float = 5.0
    ) -> None:
        self._client = client
        self._api_key = api_key
        self._every_s = every_s
        self._known: set[str] = set()
        self._checked_at: float | None = None
        self._lock = anyio.Lock()

    def due(self) -> bool:
        """Whether the trainer's list should be read again (at most every
        `every_s` seconds: it is read for every episode)."""
        return self._checked_at is None or time.monotonic() - self._checked_at >= self._every_s

    async def sync(self, addresses: Iterable[str]) -> None:
        """Make the session servers' pools hold exactly `addresses` of the
        trainer's (workers registered by others are left alone)."""
        wanted = {worker_url(a) for a in addresses}
        async with self._lock:
            for url in sorted(wanted - self._known):
                await self._client.add_worker(url, api_key=self._api_key)
                self._known.add(url)
                logger.info("registered the trainer's server %s with the session servers", url)
            for url in sorted(self._known - wanted):
                await self._client.remove_worker(url, api_key=self._api_key)
                self._known.discard(url)
                logger.info("removed the trainer's server %s from the session servers", url)
            self._checked_at = time.monotonic()
