"""Interrupting requests for a pause in abort mode
(docs/training.md#interrupted-turns-and-policy-versions).

Every abortable request in flight is registered on its worker by the id it
was sent with (`Worker.requests`). `interrupt` holds every request not yet
sent until `resume_sending`, and asks each worker, with its dialect's abort
route, to abort the ones it has: each then answers ``abort`` with what it
had sampled, and the turn runner continues it after the resume.
"""

from __future__ import annotations

import logging

import httpx
import trio

from .client import transport_detail
from .control import Control
from .membership import Membership
from .options import PoolOptions
from .worker import Worker

__all__ = ["Interrupts"]

logger = logging.getLogger("rollout_session")


class Interrupts:
    def __init__(
        self,
        members: Membership,
        options: PoolOptions,
        probe_client: httpx.AsyncClient,
        control: Control,
    ) -> None:
        self._members = members
        self._abort_requests = options.dialect.abort_requests
        # The probe client: a worker's traffic connections may all be held
        # by the very requests being aborted.
        self._client = probe_client
        self._control = control
        # Set while requests may be sent; cleared by `interrupt`.
        self._sending = trio.Event()
        self._sending.set()

    async def wait_to_send(self) -> None:
        """Return once requests may be sent (at once unless interrupted)."""
        await self._sending.wait()

    async def interrupt(self) -> int:
        """Hold every request not yet sent until `resume_sending`, and ask
        each worker to abort the ones it has. Returns how many were asked. A
        worker that cannot be reached is logged and skipped: its requests
        finish (or fail) as they would have."""
        if self._sending.is_set():
            self._sending = trio.Event()
        asked = [(w, sorted(w.requests)) for w in self._members.workers.values() if w.requests]
        async with trio.open_nursery() as nursery:
            for worker, ids in asked:
                for path, body in self._abort_requests(ids):
                    nursery.start_soon(self._abort, worker, path, body)
        return sum(len(ids) for _, ids in asked)

    def resume_sending(self) -> None:
        self._sending.set()

    async def _abort(self, worker: Worker, path: str, body: bytes) -> None:
        try:
            response = await self._client.post(
                worker.url + path, content=body, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            problem = transport_detail(exc)
        else:
            if response.status_code == 200:
                return
            problem = f"answered {response.status_code}: {response.text[:200]}"
        self._control.count(worker.url, path)
        logger.warning(
            "worker %s: %s failed (%s); its turns in flight were not interrupted and "
            "finish as they would have",
            worker.url,
            path,
            problem,
        )
