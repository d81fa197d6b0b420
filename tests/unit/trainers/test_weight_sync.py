"""The session servers paused around a trainer's weight update, resumed
naming its step (rollout_session/trainers/weight_sync.py): against a real
session server, whose next turn carries the step as its policy version."""

from __future__ import annotations

import pytest

from rollout_session.trainers.weight_sync import WeightSync
from tests.conftest import Stack, StackFactory

USER = [{"role": "user", "content": "hello"}]


async def _turn_version(stack: Stack) -> str:
    session = await stack.create()
    answer = await stack.chat(session, messages=USER)
    assert answer.status_code == 200, answer.text
    version: str = (await stack.trajectory(session))["turns"][0]["weight_version"]
    return version


@pytest.mark.parametrize("mode", ["abort", "drain"])
async def test_resumed_naming_the_step(make_stack: StackFactory, mode: str) -> None:
    stack = await make_stack()
    sync = WeightSync([stack.url], mode=mode)  # type: ignore[arg-type]
    seen: list[bool] = []

    async def update() -> str:
        paused = await stack.client.post("/admin/pause", json={"mode": mode})
        seen.append(paused.json()["paused"])
        return "updated"

    assert await sync.around(7, update) == "updated"
    assert seen == [True]
    assert await _turn_version(stack) == "7"
    # A step known only once the update is done (SkyRL's sync count).
    count = [7]

    async def counting() -> None:
        count[0] += 1

    await sync.around(lambda: count[0], counting)
    assert await _turn_version(stack) == "8"


async def test_a_failed_update_resumes_without_a_new_name(make_stack: StackFactory) -> None:
    stack = await make_stack()
    sync = WeightSync([stack.url])
    await sync.around(3, _nothing)
    asked: list[int] = []

    def step() -> int:
        asked.append(1)
        return 4

    async def failing() -> None:
        raise RuntimeError("the broadcast failed")

    with pytest.raises(RuntimeError, match="broadcast failed"):
        await sync.around(step, failing)
    assert asked == []
    # Resumed (a turn goes through), still under the last named policy.
    assert await _turn_version(stack) == "3"


async def _nothing() -> None:
    return None
