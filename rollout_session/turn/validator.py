"""Where an engine's answer check runs.

`AnswerValidator.validate` runs an engine's pure, strict check (for
`sglang-chat`, `engines.sglang_chat.answer.check_answer`) in the place its
cost calls for: inline or on a thread (through `Offload`) for
most answers, in one of `--parse-processes` worker processes for answers
over `--process-threshold-kb`. A process is the only place a 1 MiB decode
does not hold this process's GIL, so the loop keeps answering /health and
other sessions while it runs (docs/performance.md#validation-off-the-loop).
The answer and the result's arrays travel in a hand-off file, not the pipe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import trio
import trio_parallel

from .handoff import Handoff
from .offload import Offload

__all__ = ["AnswerValidator"]

A = TypeVar("A")
R = TypeVar("R")


class AnswerValidator:
    def __init__(self, offload: Offload, *, processes: int, process_threshold_bytes: int) -> None:
        self._offload = offload
        self._process_count = processes
        self._process_threshold = process_threshold_bytes
        # One job per process at a time; held while a job's hand-off file
        # exists, so there are at most `processes` of them.
        self._process_limiter = trio.CapacityLimiter(max(1, processes))
        # trio-parallel wants a limiter; `_process_limiter` is already held.
        self._unbounded = trio.CapacityLimiter(math.inf)
        # Open while `run` runs (None otherwise: then every answer is
        # validated through `offload`).
        self.processes: trio_parallel.WorkerContext | None = None
        self.handoff: Handoff | None = None

    async def validate(self, check: Callable[[bytes, A], R], body: bytes, arg: A, cost: int) -> R:
        """`check(body, arg)`, wherever its `cost` (bytes that cost decode
        time) says: the engines' `Validation`.

        Not cancellable once in a process: a cancelled turn waits the few ms
        the job has left, then the cancellation applies.
        """
        workers, handoff = self.processes, self.handoff
        if workers is None or handoff is None or cost <= self._process_threshold:
            return await self._offload.run(cost, check, body, arg)
        async with self._process_limiter:
            return await handoff.run_sync(workers, check, body, arg, limiter=self._unbounded)

    async def run(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Own the validation processes until cancelled (app shutdown).

        Workers start on first use, then stay (no idle timeout: a respawn
        costs 0.1-0.4 s of imports); closing waits for running jobs.
        """
        if self._process_count == 0:
            task_status.started()
            return
        handoff = Handoff()
        try:
            async with trio_parallel.open_worker_context(
                idle_timeout=math.inf, grace_period=5.0
            ) as workers:
                self.processes, self.handoff = workers, handoff
                try:
                    task_status.started()
                    await trio.sleep_forever()
                finally:
                    self.processes = self.handoff = None
        finally:
            handoff.close()
