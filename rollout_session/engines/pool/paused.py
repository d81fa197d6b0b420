"""Workers paused by someone else: a refusal to wait out, not a failure
(docs/reliability.md#workers-the-trainer-pauses).

A trainer may pause its workers itself for a weight update (verl and SkyRL
call vLLM's ``/pause`` directly). vLLM then answers the requests in flight
with ``abort`` (``mode=abort``) and refuses every new one with 503 "Generation
is paused" until ``/resume`` (``abort`` and ``wait`` modes: vLLM 0.33
``EngineCoreProc._reject_add_while_paused``). Such a refusal
(`WorkerDialect.paused`) is the worker saying "later": nothing was sampled,
so the request is sent again, to the same worker, once the worker says it
generates again (`WorkerDialect.pause_status`, vLLM's ``GET /is_paused``,
served only under ``VLLM_SERVER_DEV_MODE``: where it cannot be read, the
requests are sent again after a growing wait instead). It
never counts on the worker's circuit and never reaches the agent; a pause
longer than ``--pause-wait-s`` ends the turn with 503 ``server_paused``, as
this server's own pause does. SGLang holds a request that arrives while it
is paused until ``/continue_generation`` (its dialect has no `paused`).

One watcher per paused worker polls its status, however many requests
wait on it (every agent's continuation after an abort pause arrives at
once): each waiter waits on the watcher's event.
"""

from __future__ import annotations

import logging
import math

import trio

from ...errors import ServerPaused, UpstreamError
from .client import TRANSPORT_ERRORS, get_json
from .membership import Membership
from .options import PoolOptions
from .worker import Worker

__all__ = ["Pauses"]

logger = logging.getLogger("rollout_session")

# How often a paused worker's status is read: first soon (a pause for a
# weight sync is seconds), then no more than once a second.
_FIRST_POLL_S = 0.05
_MAX_POLL_S = 1.0


class Pauses:
    def __init__(self, members: Membership, options: PoolOptions) -> None:
        self._members = members
        self._options = options
        # worker URL -> set when the worker generates again (or cannot be read).
        self._resumed: dict[str, trio.Event] = {}
        # worker URL -> the wait before its next status read or resend: grows
        # while the pause lasts, forgotten once a request gets through (`ended`).
        self._interval: dict[str, float] = {}

    def ended(self, worker: Worker) -> None:
        """A request to `worker` was answered, not refused as paused."""
        self._interval.pop(worker.url, None)

    async def wait(self, worker: Worker, deadline: float) -> None:
        """Until `worker` generates again; `ServerPaused` past `deadline`
        (trio time), `UpstreamError` when it leaves the pool meanwhile."""
        event = self._resumed.get(worker.url)
        if event is None:
            event = self._resumed[worker.url] = trio.Event()
            worker.paused_refusals += 1
            logger.info(
                "worker %s is paused (by its trainer): requests wait until it resumes",
                worker.url,
            )
            if not self._members.start_soon(self._watch, worker, event):
                del self._resumed[worker.url]
                event.set()  # no pool running: the caller sends again at once
        else:
            worker.paused_refusals += 1
        with trio.move_on_at(deadline):
            await event.wait()
        if not event.is_set():
            wait_s = self._options.worker_pause_wait_s
            raise ServerPaused(
                f"worker {worker.url} is paused and did not resume within {wait_s:g} s",
                retry_after_s=max(1, math.ceil(wait_s)),
            )
        if not self._members.member(worker):
            raise UpstreamError(f"worker {worker.url} left the pool while it was paused")

    async def _watch(self, worker: Worker, event: trio.Event) -> None:
        status = self._options.dialect.pause_status
        assert status is not None  # a dialect with `paused` says how to ask
        path, read = status
        try:
            while self._members.member(worker):
                interval = self._interval.get(worker.url, _FIRST_POLL_S)
                self._interval[worker.url] = min(2 * interval, _MAX_POLL_S)
                await trio.sleep(interval)
                try:
                    with trio.fail_after(self._options.health_timeout_s):
                        answer = await get_json(worker.client, path)
                except (trio.TooSlowError, UpstreamError, *TRANSPORT_ERRORS):
                    # Cannot tell (no dev mode): the requests are sent again
                    # and find out; the wait keeps growing until one passes.
                    return
                if read(answer) is False:
                    logger.info("worker %s resumed: waiting requests are sent again", worker.url)
                    self._interval.pop(worker.url, None)
                    return
        finally:
            del self._resumed[worker.url]
            event.set()
