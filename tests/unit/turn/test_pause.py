"""Pausing turns: drain waits for turns at workers, abort interrupts them,
and an interrupted turn waiting to continue is not at a worker."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from rollout_session.errors import ServerPaused
from rollout_session.turn.pause import PauseGate, PauseMode


async def test_drain_waits_for_a_turn_at_a_worker(autojump_clock: trio.abc.Clock) -> None:
    gate = PauseGate(5.0)
    at_worker = trio.Event()

    async def turn() -> None:
        async with gate.turn():
            at_worker.set()
            await trio.sleep(10)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await at_worker.wait()
        started = trio.current_time()
        await gate.pause(PauseMode.DRAIN)
        assert trio.current_time() - started == pytest.approx(10)


async def test_an_interrupted_turn_goes_on_at_once_when_not_paused() -> None:
    gate = PauseGate(5.0)
    async with gate.turn():
        assert await gate.wait_to_continue() == 0.0
        assert gate.inflight == 1


async def test_a_turn_waiting_to_continue_does_not_hold_a_drain(
    autojump_clock: trio.abc.Clock,
) -> None:
    gate = PauseGate(5.0)
    waited: list[float] = []
    at_worker = trio.Event()

    async def turn() -> None:
        async with gate.turn():
            at_worker.set()
            await trio.sleep(1)  # the worker's abort comes back during the pause
            waited.append(await gate.wait_to_continue())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await at_worker.wait()
        await gate.pause(PauseMode.DRAIN)  # returns once the turn waits to continue
        assert gate.inflight == 0 and gate.waiting == 1
        await trio.sleep(3)
        gate.resume("v2")
    assert gate.declared_version == "v2" and gate.waiting == 0 and gate.inflight == 0
    assert waited == [pytest.approx(3.0)]


async def test_abort_interrupts_and_answers_at_once() -> None:
    calls: list[str] = []

    async def interrupt() -> int:
        calls.append("interrupt")
        return 3

    gate = PauseGate(5.0, interrupt=interrupt, resume_sending=lambda: calls.append("resume"))
    held = trio.Event()

    async def turn() -> None:
        async with gate.turn():
            held.set()
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await held.wait()
        assert await gate.pause(PauseMode.ABORT) == 3
        assert gate.paused and calls == ["interrupt"]
        gate.resume()
        assert not gate.paused and calls == ["interrupt", "resume"]
        assert gate.declared_version is None
        nursery.cancel_scope.cancel()


async def test_new_turns_wait_then_503() -> None:
    gate = PauseGate(2.0)
    await gate.pause(PauseMode.ABORT)
    with pytest.raises(ServerPaused):
        async with gate.turn():
            pass


@pytest.mark.parametrize("stopped_at", [None, 3.0], ids=["no-stop", "stopped-while-waiting"])
async def test_a_stop_ends_a_wait_at_once_and_admits_nothing(
    autojump_clock: trio.abc.Clock, stopped_at: float | None
) -> None:
    """A new turn whose session stops while it waits out a pause is not
    admitted (False, uncounted) when its stop is set; without one it waits
    the whole --pause-wait-s and is refused 503."""
    gate = PauseGate(30.0)
    await gate.pause()
    stop = trio.Event()
    outcome: list[object] = []

    async def turn() -> None:
        try:
            async with gate.turn(stop) as admitted:
                outcome.append(admitted)
        except ServerPaused as exc:
            outcome.append(exc)

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.held == 1
        if stopped_at is not None:
            await trio.sleep(stopped_at)
            stop.set()
    waited = trio.current_time() - started
    assert gate.held == 0 and gate.inflight == 0
    if stopped_at is None:
        (refused,) = outcome
        assert isinstance(refused, ServerPaused) and waited == pytest.approx(30.0)
    else:
        assert outcome == [False] and waited == pytest.approx(stopped_at)


async def test_a_stop_already_set_or_no_pause_admits_as_before() -> None:
    gate = PauseGate(30.0)
    stop = trio.Event()
    stop.set()
    async with gate.turn(stop) as admitted:  # not paused: the gate does not look at it
        assert admitted is True and gate.inflight == 1
    await gate.pause()
    async with gate.turn(stop) as admitted:
        assert admitted is False and gate.inflight == 0
