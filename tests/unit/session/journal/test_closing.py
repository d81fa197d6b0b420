"""The journal's record of a close in progress, and its health flag.

A DELETE that began collecting an open session is journaled as an expiry
(unpinned): replay, or a compaction taken meanwhile, brings the session back
expired with its whole trajectory, never open; a ``close`` record then
forgets it as before. The journal says whether it can record
a change now: not from a failed write until it has written again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from rollout_session.session.journal import format as fmt
from rollout_session.session.journal import writer as journal_module
from rollout_session.session.journal.writer import Journal, JournalError
from rollout_session.session.session import SessionState
from tests.unit.session.journal.test_journal import (
    NOW,
    do_turn,
    new_session,
    replayed,
    running,
    states,
)


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


async def test_not_writable_from_a_failed_write_until_it_writes_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = await Journal.open(tmp_path, retry_s=0.01)
    assert journal.writable
    healthy = fmt.write_records
    failing = True

    def flaky(*args: Any) -> None:
        if failing:
            raise OSError(5, "Input/output error")
        healthy(*args)

    monkeypatch.setattr(journal_module, "write_records", flaky)
    session = new_session("s")
    journal.create(session)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        with pytest.raises(JournalError):
            await journal.wait_durable()
        assert not journal.writable
        with pytest.raises(JournalError):
            journal.closing(session)
        failing = False
        await journal.wait_writable()
        journal.create(new_session("t"))
        await journal.wait_durable()
        await journal.aclose()
    assert set(await replayed(tmp_path)) == {"t"}  # the lost create is not there
