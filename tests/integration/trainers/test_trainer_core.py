"""The trainers wing's shared core against a real session server and
emulator workers (no trainer installed): an episode's session life, the
trainer's servers registered as workers, the pause around a weight update."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import trio
from openai import AsyncOpenAI

from rollout_session.client import SessionClient
from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.trainers import AgentSession, EpisodeFailed, run_episode
from rollout_session.trainers.weight_sync import WeightSync
from rollout_session.trainers.workers import WorkerSync
from tests.conftest import Stack, StackFactory, spawn_worker

PINNED = {"temperature": 0.3, "top_p": 0.9}


async def one_turn(session: AgentSession, temperature: float = 1.7) -> None:
    async with AsyncOpenAI(
        base_url=session.base_url, api_key=session.api_key, max_retries=0
    ) as client:
        await client.chat.completions.create(
            model=session.model,
            messages=[{"role": "user", "content": "hello"}],
            temperature=temperature,
        )


async def rewarded(session: AgentSession, row: Mapping[str, Any]) -> float | None:
    await one_turn(session)
    return float(row["reward"])


async def test_an_episode_pins_the_trainers_sampling_and_collects_its_session(stack: Stack) -> None:
    async with SessionClient([stack.url]) as client:
        episode = await run_episode(
            client, rewarded, {"reward": 2}, sampling=PINNED, metadata={"k": "v"}
        )
    assert episode.reward == 2.0
    [segment] = episode.document["segments"]
    [turn] = segment["turns"]
    assert {k: turn["sampling"][k] for k in PINNED} == PINNED  # not the agent's 1.7
    assert (await stack.client.get("/health")).json()["sessions"] == 0


class Broke(RuntimeError):
    pass


async def breaks(session: AgentSession, row: Mapping[str, Any]) -> float | None:
    await one_turn(session)
    raise Broke("harness crashed")


async def says_nonsense(session: AgentSession, row: Mapping[str, Any]) -> Any:
    await one_turn(session)
    return "great"


@pytest.mark.parametrize(
    ("agent", "cause"),
    [(breaks, Broke), (says_nonsense, TypeError)],
    ids=["raises", "not-a-reward"],
)
async def test_a_failed_agent_drops_its_episode_and_leaves_no_session(
    stack: Stack, agent: Any, cause: type[Exception]
) -> None:
    async with SessionClient([stack.url]) as client:
        with pytest.raises(EpisodeFailed, match="the episode is dropped") as failed:
            await run_episode(client, agent, {})
    assert isinstance(failed.value.__cause__, cause)
    assert (await stack.client.get("/health")).json()["sessions"] == 0


async def test_the_trainers_servers_follow_its_list(
    nursery: trio.Nursery, make_stack: StackFactory, text_model: TextModel
) -> None:
    """A server the trainer lists is added (once), one it drops is removed;
    the workers the session server was started with are left alone."""
    stack = await make_stack()
    extra = await spawn_worker(nursery, text_model, EmulatorConfig(seed=3))
    started = stack.emulator_url

    async def urls() -> list[str]:
        return [w["url"] for w in (await stack.client.get("/workers")).json()["workers"]]

    async with SessionClient([stack.url]) as client:
        sync = WorkerSync(client, every_s=60)
        assert sync.due()
        await sync.sync([extra.url.removeprefix("http://")])  # verl's host:port
        assert not sync.due()
        assert await urls() == [started, extra.url]
        await sync.sync([extra.url])  # known: not added again
        await sync.sync([])
        assert await urls() == [started]


async def test_a_weight_update_names_its_step(stack: Stack) -> None:
    """Turns after the update carry its step as their version; an update
    that fails resumes the servers without a new name."""
    sync = WeightSync([stack.url], mode="abort")
    paused: list[bool] = []

    async def update() -> str:
        paused.append(stack.ctx.pause.paused)
        return "done"

    assert await sync.around(7, update) == "done"
    assert paused == [True] and not stack.ctx.pause.paused

    async def broken() -> None:
        raise Broke("the update failed")

    with pytest.raises(Broke):
        await sync.around(8, broken)
    assert not stack.ctx.pause.paused
    async with SessionClient([stack.url]) as client:
        episode = await run_episode(client, rewarded, {"reward": 0})
    [turn] = episode.document["segments"][0]["turns"]
    assert [span["version"] for span in turn["weight_versions"]] == ["7"]
