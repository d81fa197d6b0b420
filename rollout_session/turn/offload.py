"""Where CPU-bound work on request data runs: inline, or on a worker thread.

Parsing a chat body, planning its prompt, rendering an SSE stream or a
trajectory document are CPU work on data whose size the agent chooses. One
`Offload` per app decides, by that size, whether the work runs inline or on
one of `--cpu-threads` threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import trio

__all__ = ["Offload"]

T = TypeVar("T")


class Offload:
    def __init__(self, *, threshold_bytes: int, threads: int) -> None:
        self.threshold_bytes = threshold_bytes
        self.limiter = trio.CapacityLimiter(threads)

    async def run(self, nbytes: int, fn: Callable[..., T], *args: object, **kw: object) -> T:
        """Run `fn` on a worker thread when its input is `nbytes` over the
        threshold, else inline.

        Small inputs run inline: the thread hop costs more than it saves
        (docs/performance.md#parsing-on-the-loop-not-on-threads). The limiter
        bounds threads; orjson/msgspec hold the GIL, so this keeps the loop
        responsive (health checks, other sessions) rather than adding
        throughput.
        """
        call = functools.partial(fn, *args, **kw)
        if nbytes <= self.threshold_bytes:
            return call()
        return await trio.to_thread.run_sync(call, limiter=self.limiter)
