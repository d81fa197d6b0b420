"""A server whose journal's filesystem fills mid-run, then has room again.

Agents run turns while the journal's disk (a `TinyDisk`: see
tests/tiny_disk.py) fills under them. Meanwhile: every change answers 503
``journal_unavailable`` and changes nothing, `/health` says ``degraded`` and
`/ready` is 503; no acknowledged turn is lost and no turn answered 503 is
kept, in memory or in a crash image of the journal. Once there is room the
server takes changes again by itself: the agents' retried turns go through,
and a DELETE, retried, collects each session, a repeated one answering with
the same document, before and after a restart.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import Stack, StackFactory
from tests.integration.journal.test_session_store import USER, assert_unavailable, state_of
from tests.integration.session.test_turns import echo
from tests.tiny_disk import tiny_disk


@dataclass
class Agent:
    """An OpenAI-style agent that retries a turn its server refused."""

    stack: Stack
    session_id: str
    messages: list[dict[str, Any]] = field(default_factory=lambda: list(USER))
    answers: list[str | None] = field(default_factory=list)  # acknowledged, in order
    refused: int = 0

    async def turn(self) -> None:
        response = await self.stack.chat(self.session_id, messages=self.messages)
        if response.status_code != 200:
            assert_unavailable(response)
            self.refused += 1
            return
        message = response.json()["choices"][0]["message"]
        self.answers.append(message["content"])
        n = len(self.answers)
        self.messages = [*self.messages, echo(message), {"role": "user", "content": f"go on {n}"}]

    async def until(self, acknowledged: int) -> None:
        while len(self.answers) < acknowledged:
            await self.turn()


async def all_agents(agents: list[Agent], run: Any) -> None:
    async with trio.open_nursery() as nursery:
        for agent in agents:
            nursery.start_soon(run, agent)


def assert_holds_exactly_its_acknowledged_turns(doc: dict[str, Any], agent: Agent) -> None:
    answers = [m["content"] for m in doc["messages"] if m["role"] == "assistant"]
    assert len(doc["turns"]) == len(agent.answers)
    assert answers == agent.answers


async def test_a_journal_whose_disk_fills_mid_run(
    make_stack: StackFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live, crash = tmp_path / "journal", tmp_path / "crash"
    disk = tiny_disk(monkeypatch, live)
    stack = await make_stack(journal=str(live), journal_retry_s=0.02)
    journal = stack.ctx.store.journal
    assert journal is not None
    agents = [Agent(stack, await stack.create(session_id=f"agent{i}")) for i in range(4)]
    await all_agents(agents, lambda agent: agent.until(2))

    # The disk fills while every agent tries two more turns at once: room
    # for about two turn records.
    disk.fill(spare=2500)
    await all_agents(agents, lambda agent: agent.turn())
    await all_agents(agents, lambda agent: agent.turn())
    through = sum(len(a.answers) for a in agents) - 8
    assert 0 < through < 8  # it filled mid-run: some turns went through, then none
    disk.fill(spare=0)  # and none at all now (the journal cannot get back meanwhile)
    await all_agents(agents, lambda agent: agent.turn())
    assert disk.refused and sum(a.refused for a in agents) >= 4
    assert not journal.writable

    health = (await stack.client.get("/health")).json()
    assert health["status"] == "degraded" and health["journal"] == "unavailable"
    assert_unavailable(await stack.client.get("/ready"))
    assert_unavailable(await stack.client.delete("/sessions/agent0"))
    assert await state_of(stack, "agent0") == "open"
    assert_unavailable(await stack.client.post("/sessions"))
    for agent in agents:  # no acknowledged turn lost, no refused one kept
        assert_holds_exactly_its_acknowledged_turns(await stack.trajectory(agent.session_id), agent)
    shutil.copytree(live, crash)  # what a server killed now leaves
    acknowledged = {a.session_id: list(a.answers) for a in agents}

    # Room again: the server takes changes by itself.
    disk.free()
    with trio.fail_after(10):
        await journal.wait_writable()
    assert (await stack.client.get("/ready")).status_code == 200
    assert (await stack.client.get("/health")).json()["status"] == "ok"
    await all_agents(agents, lambda agent: agent.until(len(agent.answers) + 2))
    docs: dict[str, bytes] = {}
    for agent in agents:
        collected = await stack.client.delete(f"/sessions/{agent.session_id}")
        assert collected.status_code == 200, collected.text
        assert_holds_exactly_its_acknowledged_turns(collected.json()["segments"][-1], agent)
        again = await stack.client.delete(f"/sessions/{agent.session_id}")
        assert again.content == collected.content  # the same document
        docs[agent.session_id] = collected.content

    # A restart on the crash image: what was acknowledged then, nothing more.
    crashed = await make_stack(journal=str(crash))
    for session_id, answers in acknowledged.items():
        doc = await crashed.trajectory(session_id)
        assert doc["status"] == "open"
        assert [m["content"] for m in doc["messages"] if m["role"] == "assistant"] == answers
    # A restart on the journal now: the collected sessions, readable as collected.
    shutil.copytree(live, tmp_path / "later")
    later = await make_stack(journal=str(tmp_path / "later"))
    for session_id, content in docs.items():
        again = await later.client.delete(f"/sessions/{session_id}")
        assert again.status_code == 200 and again.content == content


async def test_a_turn_refused_while_the_disk_is_full_is_never_sent_to_a_worker(
    make_stack: StackFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = tiny_disk(monkeypatch, tmp_path)
    stack = await make_stack(journal=str(tmp_path), journal_retry_s=0.02)
    agent = Agent(stack, await stack.create())
    await agent.turn()
    disk.fill(spare=0)
    assert_unavailable(await stack.client.post("/sessions"))  # the write that fails
    received = stack.emulator.received
    await agent.turn()
    assert agent.refused == 1 and stack.emulator.received == received
    disk.free()
    journal = stack.ctx.store.journal
    assert journal is not None
    with trio.fail_after(10):
        await journal.wait_writable()
    await agent.turn()
    assert len(agent.answers) == 2
    client: httpx.AsyncClient = stack.client
    assert (await client.post("/sessions")).status_code == 201
