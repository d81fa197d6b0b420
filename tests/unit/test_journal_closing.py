"""The journal's record of a close in progress, and its health flag.

A DELETE that began collecting an open session is journaled as an expiry
(unpinned): replay, or a compaction taken meanwhile, brings the session back
expired with its whole trajectory, never open; the collection's ``close``
record then forgets it as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from rollout_session.journal import Journal, JournalError
from rollout_session.sessions import SessionState

from .test_journal import NOW, do_turn, new_session, replayed, running, states


@pytest.mark.parametrize("compacted", [False, True], ids=["appended", "compacted"])
async def test_a_close_in_progress_replays_as_expired(tmp_path: Path, compacted: bool) -> None:
    rng = np.random.default_rng(11)
    async with running(tmp_path) as (journal, _):
        session, collected = new_session("closing"), new_session("collected")
        for s in (session, collected):
            journal.create(s)
            do_turn(journal, s, rng)
            s.begin_close(NOW + 5)
            journal.closing(s)
        journal.close(collected.id)  # this one's collection finished
        if compacted:  # the snapshot of a closing session is expired as well
            await journal.compact()
        await journal.wait_durable()
        expected = states([session])
    restored = await replayed(tmp_path)
    assert set(restored) == {"closing"}
    expected["closing"]["life"] = (SessionState.EXPIRED, NOW + 5, "m", None)
    assert restored == expected


async def test_writable_until_the_writer_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = await Journal.open(tmp_path)
    assert journal.writable

    def broken(*args: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("rollout_session.journal.write_records", broken)
    session = new_session("s")
    journal.create(session)
    with pytest.raises(ExceptionGroup):
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
    assert not journal.writable
    with pytest.raises(JournalError):
        journal.closing(session)
