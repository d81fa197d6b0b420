"""A collection that can be retried.

A DELETE'd session stays readable for ``--keep-collected-s``: a repeated
DELETE (or a GET) answers with the same document, also across a restart,
and a DELETE arriving while another is under way answers with its outcome.
Then the session is forgotten, durably. `SessionClient.close` retries a
DELETE whose answer was lost and gets the document.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from rollout_session.client import SessionClient, TrajectoryLost
from rollout_session.session.session import SessionState
from tests.conftest import Stack, StackFactory
from tests.integration.journal.test_session_store import (
    USER,
    assert_error,
    closing,
    crash_image,
    pinned,
    second_turn,
    settled,
    state_of,
)
from tests.tiny_disk import tiny_disk


async def two_turns(stack: Stack, **create: Any) -> str:
    session_id = await stack.create(**create)
    first = await stack.chat(session_id, messages=USER)
    assert (await stack.chat(session_id, messages=second_turn(first))).status_code == 200
    return session_id


@pytest.mark.parametrize("journaled", [False, True], ids=["memory", "journal"])
async def test_a_repeated_delete_returns_the_same_document(
    make_stack: StackFactory, tmp_path: Path, journaled: bool
) -> None:
    stack = await make_stack(**({"journal": str(tmp_path)} if journaled else {}))
    session_id = await two_turns(stack, metadata={"episode": 3})
    before = await stack.trajectory(session_id)
    collected = await stack.client.delete(f"/sessions/{session_id}")
    assert collected.status_code == 200
    doc = collected.json()
    assert doc["status"] == "closed" and doc["segments"][-1]["token_ids"] == before["token_ids"]
    again = await stack.client.delete(f"/sessions/{session_id}")
    assert again.status_code == 200 and again.content == collected.content
    assert await stack.trajectory(session_id, schema=3) == doc
    assert await state_of(stack, session_id) == "closed"
    assert_error(await stack.chat(session_id, messages=USER), 404, "session_not_found")
    # Collected: not listed among the sessions to collect, unpinned, uncounted.
    assert (await stack.client.get("/sessions")).json()["sessions"] == []
    listed = (await stack.client.get("/sessions", params={"state": "closed"})).json()
    assert [s["session_id"] for s in listed["sessions"]] == [session_id]
    assert await pinned(stack) == 0
    assert (await stack.client.get("/health")).json()["sessions"] == 0


async def test_a_collected_session_is_readable_after_a_restart_then_forgotten(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    live = tmp_path / "live"
    stack = await make_stack(journal=str(live), keep_collected_s=60)
    session_id = await two_turns(stack)
    collected = await stack.client.delete(f"/sessions/{session_id}")
    shutil.copytree(live, tmp_path / "crash")
    restarted = await make_stack(journal=str(tmp_path / "crash"), keep_collected_s=60)
    again = await restarted.client.delete(f"/sessions/{session_id}")
    assert again.status_code == 200 and again.content == collected.content
    assert await state_of(restarted, session_id) == "closed"
    assert await pinned(restarted) == 0

    session = stack.ctx.registry.get(session_id)
    stack.ctx.expiry.once()
    assert await state_of(stack, session_id) == "closed"  # within its window
    assert session.closed_at is not None
    session.closed_at -= 61
    stack.ctx.expiry.once()
    assert_error(await stack.client.delete(f"/sessions/{session_id}"), 404, "session_not_found")
    assert_error(await stack.client.get(f"/sessions/{session_id}"), 404, "session_not_found")
    await settled(stack)
    assert session_id not in {s.id for s in await crash_image(live, tmp_path / "later")}


async def test_keep_collected_zero_forgets_at_the_next_pass(make_stack: StackFactory) -> None:
    stack = await make_stack(keep_collected_s=0)
    session_id = await stack.create()
    assert (await stack.client.delete(f"/sessions/{session_id}")).status_code == 200
    session = stack.ctx.registry.get(session_id)
    assert session.closed_at is not None
    session.closed_at -= 0.001
    stack.ctx.expiry.once()
    assert_error(await stack.client.get(f"/sessions/{session_id}"), 404, "session_not_found")


async def test_a_delete_while_another_is_under_way_answers_with_its_document(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    stack = await make_stack(journal=str(tmp_path))
    session_id = await two_turns(stack)
    second: list[httpx.Response] = []
    async with closing(stack, session_id) as close:

        async def retry() -> None:
            second.append(await stack.client.delete(f"/sessions/{session_id}"))

        close.trainer.start_soon(retry)
        await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        waited = second == []  # for the close under way
        close.turn_wound_down()
    assert waited
    first = close.answers[0]
    assert first.status_code == second[0].status_code == 200
    assert first.content == second[0].content


async def test_an_id_held_by_a_collected_session_can_be_created_again(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    live = tmp_path / "live"
    stack = await make_stack(journal=str(live), max_sessions=1)
    session_id = await two_turns(stack, session_id="episode")
    assert (await stack.client.delete(f"/sessions/{session_id}")).status_code == 200
    assert (await stack.client.post("/sessions", json={"session_id": "episode"})).status_code == 201
    doc = await stack.trajectory("episode")
    assert doc["status"] == "open" and doc["turns"] == []
    await settled(stack)
    (restored,) = await crash_image(live, tmp_path / "crash")
    assert restored.state is SessionState.OPEN and not restored.trajectory.turns


class LosesDeleteAnswers(httpx.AsyncBaseTransport):
    """The network between trainer and server: the first DELETE reaches the
    server, and its answer is lost on the way back."""

    def __init__(self, after_loss: Callable[[], None] = lambda: None) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._after_loss = after_loss
        self.lost = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if request.method == "DELETE" and not self.lost:
            await response.aread()
            await response.aclose()
            self.lost += 1
            self._after_loss()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_session_client_close_survives_a_lost_answer(stack: Stack) -> None:
    network = LosesDeleteAnswers()
    async with SessionClient([stack.url], transport=network, backoff_s=0.01) as client:
        handle = await client.create()
        first = await stack.chat(handle.session_id, messages=USER)
        assert first.status_code == 200
        before = await client.trajectory(handle.session_id)
        doc = await client.close(handle.session_id)
    assert network.lost == 1
    assert doc["status"] == "closed" and doc["segments"] == before["segments"]


async def test_session_client_close_says_when_the_server_forgot_it_meanwhile(
    stack: Stack,
) -> None:
    def window_over() -> None:  # the retry comes after --keep-collected-s
        for session in stack.ctx.registry.collected():
            stack.ctx.store.forget(session)

    network = LosesDeleteAnswers(window_over)
    async with SessionClient([stack.url], transport=network, backoff_s=0.01) as client:
        handle = await client.create()
        with pytest.raises(TrajectoryLost, match="no longer holds"):
            await client.close(handle.session_id)


async def test_a_create_that_fails_to_take_over_a_collected_id_leaves_it_collected(
    make_stack: StackFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = tmp_path / "live"
    disk = tiny_disk(monkeypatch, live)
    stack = await make_stack(journal=str(live), journal_retry_s=0.02)
    await two_turns(stack, session_id="episode")
    collected = await stack.client.delete("/sessions/episode")
    disk.fill(spare=0)
    refused = await stack.client.post("/sessions", json={"session_id": "episode"})
    assert_error(refused, 503, "journal_unavailable")
    again = await stack.client.delete("/sessions/episode")
    assert again.status_code == 200 and again.content == collected.content
    disk.free()
    journal = stack.ctx.store.journal
    assert journal is not None
    with trio.fail_after(10):
        await journal.wait_writable()
    (restored,) = await crash_image(live, tmp_path / "crash")
    assert restored.state is SessionState.COLLECTED and len(restored.trajectory.turns) == 2
