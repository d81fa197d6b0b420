"""Best-effort calls to workers, and the worker-side sessions they close.

A control call (SGLang's ``/close_session``; an abort, `interrupts`) never
fails a turn or delays a DELETE: it runs on the pool's small probe client,
in the background where it can. It is never silent either: every failure is
counted (per worker in ``GET /workers``, in total in
``rollout_control_failures_total``) and logged once per worker and call —
a dead worker would otherwise log once per session.

Worker-side sessions: with ``--kv-sessions hint`` each session's turns name
it to the worker, and `close_remote` drops the worker's reference to its KV
when the session ends or moves; delta-sync's sessions are closed by their
worker-side id (`close_worker_session`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import httpx
import trio

from ..base import EngineSession
from .client import transport_detail
from .membership import Membership

__all__ = ["Control"]

logger = logging.getLogger("rollout_session")

_CLOSE_SESSION = "POST /close_session"


class Control:
    def __init__(
        self,
        members: Membership,
        probe_client: httpx.AsyncClient,
        *,
        session_hints: bool,
        timeout_s: float,
    ) -> None:
        self._members = members
        self._client = probe_client
        # --kv-sessions hint: sessions are named to their workers.
        self._session_hints = session_hints
        self._timeout_s = timeout_s  # for the closes of a shutdown
        # Failed calls by call, over all workers (the metric).
        self.failures: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()

    def count(self, url: str, call: str) -> None:
        """A control call to `url` failed (its caller logs it)."""
        self.failures[call] += 1
        worker = self._members.workers.get(url)
        if worker is not None:
            worker.control_failures[call] += 1
        self._members.notify()

    def _failed(self, url: str, call: str, detail: str) -> None:
        self.count(url, call)
        if (url, call) in self._logged:
            return
        self._logged.add((url, call))
        logger.warning(
            "worker %s: %s failed (%s); ignored (best effort), and further failures of "
            "it on this worker are only counted. Behind a gateway without the route "
            "(smg), --kv-sessions hint releases no KV: SGLang evicts it itself",
            url,
            call,
            detail,
        )

    # -- worker-side sessions -----------------------------------------------------

    def close_remote(self, url: str, session_id: str) -> None:
        """With --kv-sessions hint, drop the session's reference to its KV on
        the worker at `url` now (in the background), so SGLang may evict it first."""
        if self._session_hints:
            self.close_worker_session(url, session_id)

    def close_worker_session(self, url: str, remote_id: str) -> None:
        """Close the worker-side session `remote_id` on `url` (in the
        background, best effort: a dead worker must not delay a turn)."""
        self._members.start_soon(self._close_session, url, remote_id)

    async def close_remote_sessions(self, sessions: Iterable[EngineSession]) -> None:
        """Server shutdown, with --kv-sessions hint: close every session's
        worker-side session now (best effort: what is left stays referenced
        until the worker evicts it)."""
        if self._session_hints:
            await self.close_worker_sessions([(s.worker, s.id) for s in sessions if s.worker])

    async def close_worker_sessions(self, pinned: list[tuple[str, str]]) -> None:
        """Close these (worker URL, worker-side session id) pairs now,
        concurrently and within the health timeout (shutdown)."""
        if not pinned:
            return
        with trio.move_on_after(self._timeout_s) as scope:
            scope.shield = True
            async with trio.open_nursery() as nursery:
                for url, session_id in pinned:
                    nursery.start_soon(self._close_session, url, session_id)
        if scope.cancelled_caught:
            logger.warning("shutdown: not every one of %d worker sessions closed", len(pinned))
        else:
            logger.info("shutdown: closed %d worker sessions", len(pinned))

    async def _close_session(self, url: str, session_id: str) -> None:
        # The answer's body is never read.
        try:
            async with self._client.stream(
                "POST", f"{url}/close_session", json={"session_id": session_id}
            ) as response:
                status = response.status_code
        except httpx.HTTPError as exc:
            self._failed(url, _CLOSE_SESSION, transport_detail(exc))
            return
        if not 200 <= status < 300:
            self._failed(url, _CLOSE_SESSION, f"answered {status}")
