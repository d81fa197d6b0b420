"""Holding a worker's answer where a test wants it: an interrupt (a pause,
an abort, a weight update) then reaches the worker with the answer half
decoded, however loaded the machine."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import trio

from rollout_session.emulator.worker import Emulator

__all__ = ["in_flight_midway", "stalled", "until"]


def in_flight_midway(emulator: Emulator, at_least: int) -> bool:
    """A turn has decoded `at_least` tokens and not yet its whole answer."""
    return any(
        at_least <= emulator.gpu.decoded(run.progress) < run.progress.total
        for run in emulator.weights.runs()
    )


async def until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(60):  # a failure naming the wait, not a hung suite
        while not predicate():  # noqa: ASYNC110 (decoding is timed: no event per token)
            await trio.sleep(0.005)


@contextlib.asynccontextmanager
async def stalled(emulator: Emulator, when: Callable[[], bool]) -> AsyncIterator[None]:
    """Once `when` holds, stall the worker's GPU (nothing decodes, as under
    a slow step) until the block ends: the pause or abort the block sends
    reaches the worker with the answer where `when` saw it, however loaded
    the machine. A window of decode time was not enough: on CI an answer of
    a quarter still to decode (120 ms) finished before the abort arrived."""
    while True:
        await until(when)
        emulator.gpu.freeze()
        if when():  # still, on the frozen clock: no token decoded in between
            break
        emulator.gpu.thaw()
    try:
        yield
    finally:
        emulator.gpu.thaw()
