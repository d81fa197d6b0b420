"""The session store owns every life-cycle change, end to end over HTTP.

- A close, once begun, runs to its end whatever the DELETE's client does
  (and the collected session's document can be fetched again).
- A journal that cannot make a change durable changes nothing: 503
  ``journal_unavailable`` with ``Retry-After``, the session as it was.
- A close in progress when the server dies comes back expired: readable and
  collectable, never open for more turns.

A test holds a session's turn slot to stand in for an in-flight turn that is
slow to wind down once cancelled (a validation job, a journal write), and
releases it when the scenario needs the turn gone.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from rollout_session.session.journal import format as journal_format
from rollout_session.session.journal import writer as journal_module
from rollout_session.session.journal.writer import Journal, JournalError
from rollout_session.session.session import Session, SessionState, TurnSlot
from tests.conftest import Stack, StackFactory
from tests.integration.session.test_turns import echo

USER = [{"role": "user", "content": "hello"}]


def second_turn(first: httpx.Response) -> list[dict[str, Any]]:
    answer = echo(first.json()["choices"][0]["message"])
    return [*USER, answer, {"role": "user", "content": "go on"}]


async def quiet() -> None:
    """Until every task of the test, its servers and clients is blocked."""
    await trio.testing.wait_all_tasks_blocked(cushion=0.01)


@dataclass
class Closing:
    """A DELETE under way while the session's in-flight turn winds down."""

    stack: Stack
    session: Session
    slot: TurnSlot  # held by the test: the turn winding down
    trainer: trio.Nursery  # the DELETE's client runs here
    answers: list[httpx.Response]

    def turn_wound_down(self) -> None:
        self.session.release(self.slot, self.stack.ctx.registry.clock())


@asynccontextmanager
async def closing(stack: Stack, session_id: str) -> AsyncIterator[Closing]:
    """Inside, the session is `closing` and its DELETE waits for the turn
    (release it with `turn_wound_down`); on exit, the DELETE has answered."""
    session = stack.ctx.registry.get(session_id)
    slot = session.claim(stack.ctx.registry.clock())
    answers: list[httpx.Response] = []

    async def delete() -> None:
        answers.append(await stack.client.delete(f"/sessions/{session_id}"))

    async with trio.open_nursery() as trainer:
        trainer.start_soon(delete)
        await quiet()
        assert session.state is SessionState.CLOSING and slot.cancel_scope.cancel_called
        yield Closing(stack, session, slot, trainer, answers)


async def settled(stack: Stack) -> None:
    """Until the server has finished what it started, journal writes included."""
    await quiet()
    journal = stack.ctx.store.journal
    if journal is not None:
        await journal.wait_durable()  # the writes run on a worker thread
        await quiet()


async def crash_image(directory: Path, to: Path) -> list[Session]:
    """The sessions a server killed now would restore: its journal as it is."""
    shutil.copytree(directory, to)
    journal, sessions = await Journal.open(to)
    await journal.aclose()
    return sessions


async def pinned(stack: Stack) -> int:
    workers = (await stack.client.get("/workers")).json()["workers"]
    return sum(w["active_sessions"] for w in workers)


async def state_of(stack: Stack, session_id: str) -> str:
    response = await stack.client.get(f"/sessions/{session_id}")
    assert response.status_code == 200, response.text
    state: str = response.json()["state"]
    return state


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def assert_unavailable(response: httpx.Response) -> None:
    assert_error(response, 503, "journal_unavailable")
    assert int(response.headers["retry-after"]) >= 1


# --- a close runs to its end ---


@pytest.mark.parametrize("journaled", [False, True], ids=["memory", "journal"])
async def test_delete_whose_client_goes_away_mid_close_still_closes(
    make_stack: StackFactory, tmp_path: Path, journaled: bool
) -> None:
    journal = tmp_path / "journal"
    stack = await make_stack(max_sessions=1, **({"journal": str(journal)} if journaled else {}))
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    assert await pinned(stack) == 1
    async with closing(stack, session_id) as close:
        close.trainer.cancel_scope.cancel()  # the trainer's connection goes away mid-close
    assert close.answers == []
    await quiet()  # the server has seen the disconnect
    close.turn_wound_down()
    await settled(stack)
    assert list(stack.ctx.registry) == []  # collected: not among the sessions held
    assert (await stack.client.get("/sessions")).json()["sessions"] == []
    assert await state_of(stack, session_id) == "closed"
    # The answer the trainer lost can be fetched again, by a repeated DELETE.
    again = await stack.client.delete(f"/sessions/{session_id}")
    assert again.status_code == 200 and again.json()["status"] == "closed"
    assert len(again.json()["segments"][0]["turns"]) == 1
    assert await pinned(stack) == 0
    assert (await stack.client.post("/sessions")).status_code == 201  # --max-sessions 1
    if journaled:
        restored = await crash_image(journal, tmp_path / "crash")
        assert {s.id: s.state for s in restored}[session_id] is SessionState.COLLECTED


# --- a failed journal changes nothing ---


@dataclass
class Disk:
    """The journal's disk; once `full`, every write fails as on a full disk."""

    full: bool = False


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    disk = Disk()
    write = journal_format.write_records

    def write_records(fd: int, records: list[list[bytes]], sync: bool) -> None:
        if disk.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(fd, records, sync)

    monkeypatch.setattr(journal_module, "write_records", write_records)
    return disk


async def assert_every_change_refused(stack: Stack, session_id: str) -> None:
    """With the writer failed: no change reaches memory or a worker; reads answer."""
    doc = await stack.trajectory(session_id)
    received = stack.emulator.received
    # Refused at the claim: before the request is parsed or any worker asked.
    assert_unavailable(await stack.chat(session_id, messages=USER))
    assert stack.emulator.received == received
    assert_unavailable(await stack.client.delete(f"/sessions/{session_id}"))
    assert await state_of(stack, session_id) == "open"
    assert await stack.trajectory(session_id) == doc
    assert_unavailable(await stack.client.post("/sessions", json={"session_id": "later"}))
    assert "later" not in {s.id for s in stack.ctx.registry}
    health = await stack.client.get("/health")
    assert health.status_code == 200 and health.json()["journal"] == "unavailable"
    assert_unavailable(await stack.client.get("/ready"))
    assert "rollout_journal_writable 0.0" in (await stack.client.get("/metrics")).text


CHANGES = ["turn", "new-segment", "retry", "create", "close-while-a-turn-winds-down", "close"]


@pytest.mark.parametrize("change", CHANGES, ids=CHANGES)
async def test_a_change_the_journal_fails_to_make_durable_changes_nothing(
    make_stack: StackFactory,
    tmp_path: Path,
    disk: Disk,
    change: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stack = await make_stack(journal=str(tmp_path))
    bystander = await stack.create(session_id="bystander")
    assert (await stack.chat(bystander, messages=USER)).status_code == 200
    session_id = await stack.create(session_id="episode")
    first = await stack.chat(session_id, messages=USER)
    assert first.status_code == 200
    before = await stack.trajectory(session_id)
    assert await pinned(stack) == 2
    disk.full = True  # the writer fails on its next write: the one this change needs
    turns = {
        "turn": second_turn(first),
        "new-segment": [{"role": "user", "content": "something else"}],
        "retry": USER,  # replaces the first turn
    }
    if change in turns:
        assert_unavailable(await stack.chat(session_id, messages=turns[change]))
        assert await stack.trajectory(session_id) == before  # not kept in memory either
        assert stack.ctx.registry.get(session_id).slot is None
    elif change == "create":
        assert_unavailable(await stack.client.post("/sessions", json={"session_id": "new"}))
        assert_error(await stack.client.get("/sessions/new"), 404, "session_not_found")
    elif change == "close-while-a-turn-winds-down":
        async with closing(stack, session_id) as close:
            journal = stack.ctx.store.journal
            assert journal is not None
            with pytest.raises(JournalError):  # the close in progress could not be written
                await journal.wait_durable()
            close.turn_wound_down()
        assert_unavailable(close.answers[0])
        # Put back as it was: open, pinned, its trajectory whole.
        assert await state_of(stack, session_id) == "open"
        assert await stack.trajectory(session_id) == before
        assert await pinned(stack) == 2
    else:
        # The collection was queued when the write failed: not collected
        # unless durable, so the session is put back as it was.
        assert_unavailable(await stack.client.delete(f"/sessions/{session_id}"))
        assert await state_of(stack, session_id) == "open"
        assert await stack.trajectory(session_id) == before
        assert await pinned(stack) == 2
    assert "a write failed" in caplog.text
    # The writer's failure did not cancel the app's other tasks with it.
    assert stack.ctx.validator.processes is not None
    assert await pinned(stack) >= 1  # the bystander keeps its pin
    await assert_every_change_refused(stack, bystander)


async def test_a_turn_whose_worker_answers_after_the_journal_failed_commits_nothing(
    make_stack: StackFactory, tmp_path: Path, disk: Disk, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = await make_stack(journal=str(tmp_path))
    session_id = await stack.create()
    answered, go_on = trio.Event(), trio.Event()
    send = stack.ctx.pool.send

    async def gated_send(session: Session, request: Any) -> Any:
        sent = await send(session, request)
        answered.set()
        await go_on.wait()
        return sent

    monkeypatch.setattr(stack.ctx.pool, "send", gated_send)
    turn: list[httpx.Response] = []

    async def agent() -> None:
        turn.append(await stack.chat(session_id, messages=USER))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent)
        await answered.wait()  # the worker has answered; the commit is next
        disk.full = True
        assert_unavailable(await stack.client.post("/sessions"))  # the writer fails
        go_on.set()
    assert_unavailable(turn[0])
    assert stack.emulator.received == 1
    doc = await stack.trajectory(session_id)
    assert doc["turns"] == [] and doc["token_ids"] == [] and doc["messages"] == []


async def test_the_reaper_changes_nothing_once_the_journal_failed(
    make_stack: StackFactory, tmp_path: Path, disk: Disk
) -> None:
    stack = await make_stack(journal=str(tmp_path))
    session_id = await stack.create()
    disk.full = True
    assert_unavailable(await stack.client.post("/sessions"))
    stack.ctx.registry.get(session_id).last_active_at -= 10_000  # long idle
    stack.ctx.expiry.once()
    assert await state_of(stack, session_id) == "open"


# --- a close in progress at a crash ---


async def test_a_close_in_progress_at_a_crash_comes_back_expired(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    live, crash = tmp_path / "live", tmp_path / "crash"
    stack = await make_stack(journal=str(live))
    session_id = await stack.create(metadata={"episode": 7})
    first = await stack.chat(session_id, messages=USER)
    assert (await stack.chat(session_id, messages=second_turn(first))).status_code == 200
    before = await stack.trajectory(session_id)
    async with closing(stack, session_id) as close:
        journal = stack.ctx.store.journal
        assert journal is not None
        await journal.wait_durable()
        shutil.copytree(live, crash)  # what the server leaves if killed now
        close.turn_wound_down()
    assert close.answers[0].status_code == 200
    closed_at = close.answers[0].json()["closed_at"]

    restarted = await make_stack(journal=str(crash))
    summary = (await restarted.client.get(f"/sessions/{session_id}")).json()
    assert summary["state"] == "expired" and summary["worker"] is None
    assert summary["metadata"] == {"episode": 7}
    assert await pinned(restarted) == 0
    doc = await restarted.trajectory(session_id)
    assert doc["status"] == "expired" and doc["closed_at"] == closed_at
    assert {k: v for k, v in doc.items() if k not in ("status", "closed_at")} == {
        k: v for k, v in before.items() if k not in ("status", "closed_at")
    }
    assert_error(
        await restarted.chat(session_id, messages=second_turn(first)), 404, "session_not_found"
    )
    listed = (await restarted.client.get("/sessions", params={"state": "expired"})).json()
    assert [s["session_id"] for s in listed["sessions"]] == [session_id]
    collected = await restarted.client.delete(f"/sessions/{session_id}")
    assert collected.status_code == 200
    assert collected.json()["status"] == "closed"
    assert collected.json()["segments"][-1]["token_ids"] == before["token_ids"]
