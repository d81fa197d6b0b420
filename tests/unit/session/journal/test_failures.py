"""The journal when its disk fails it, and when its bytes are damaged.

- A failed write loses exactly the records not yet written: their waiters
  raise (the caller undoes them), nothing of them is left in the file, and
  the journal writes again by itself once there is room, appending the state
  of what the lost records touched.
- A failed fsync (what is on disk is then unknown) rewrites every session
  into a new segment.
- Replay streams a segment: memory is one read window, not the file.
- Damage in the middle of a segment costs only the records it covers: reading
  resynchronises on the next good frame, the sessions the damage is known to
  cost are dropped and named at ERROR, every other one replays whole.
- Turns a rollback superseded are dead bytes, so compaction reclaims them
  from live sessions too.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from rollout_session.session.commit import CommitUndo
from rollout_session.session.journal import format as fmt
from rollout_session.session.journal import reader
from rollout_session.session.journal.recovery import recover
from rollout_session.session.journal.writer import JournalError
from rollout_session.session.session import SessionState
from tests.tiny_disk import tiny_disk
from tests.unit.session.journal.test_journal import (
    NOW,
    do_turn,
    new_session,
    replayed,
    running,
    segment,
    states,
)

# --- a failed write ---


async def test_a_full_disk_loses_only_unwritten_records_and_the_journal_writes_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    live = tmp_path / "live"
    disk = tiny_disk(monkeypatch, live)
    rng = np.random.default_rng(1)
    async with running(live, retry_s=0.01) as (journal, _):
        a, b = new_session("a"), new_session("b")
        journal.create(a)
        journal.create(b)
        do_turn(journal, a, rng)
        do_turn(journal, b, rng)
        await journal.wait_durable()
        durable = states([a, b])
        size = segment(live).stat().st_size
        # The next batch does not fit: 100 of its bytes reach the file.
        disk.fill(spare=100)
        undo = CommitUndo.of(a, len(a.trajectory.turns))
        do_turn(journal, a, rng)  # a turn: its caller undoes it
        b.expire(NOW + 3)  # an expiry: nobody waits for it, it stays
        b.worker = None
        journal.expire(b)
        journal.create(new_session("c"))  # a create: the journal drops it
        with pytest.raises(JournalError):
            await journal.wait_durable()
        undo.apply(a)
        assert disk.refused and not journal.writable
        with pytest.raises(JournalError):
            journal.create(new_session("d"))
        # Nothing of the lost records is left: a crash now replays what was durable.
        assert segment(live).stat().st_size == size
        shutil.copytree(live, tmp_path / "crash")
        assert await replayed(tmp_path / "crash") == durable
        disk.free()
        await journal.wait_writable()
        journal.create(d := new_session("d"))
        await journal.wait_durable()
        expected = states([a, b, d])
    assert expected["b"]["life"][0] is SessionState.EXPIRED
    assert await replayed(live) == expected
    assert "a write failed" in caplog.text and "writing again" in caplog.text


async def test_a_failed_fsync_rewrites_every_session_into_a_new_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(2)
    real = fmt.fsync
    failures = [errno.EIO]

    def flaky(fd: int) -> None:
        if failures:
            raise fmt.SyncFailed(failures.pop(), "fsync failed: Input/output error")
        real(fd)

    async with running(tmp_path, fsync="always", retry_s=0.01) as (journal, _):
        a = new_session("a")
        journal.create(a)
        do_turn(journal, a, rng)
        await journal.wait_durable()
        monkeypatch.setattr(fmt, "fsync", flaky)
        journal.create(new_session("b"))
        with pytest.raises(JournalError):
            await journal.wait_durable()
        await journal.wait_writable()
        assert journal.stats().segment == 2
        do_turn(journal, a, rng)
        await journal.wait_durable()
        expected = states([a])
    assert segment(tmp_path).name == fmt.segment_name(2)
    assert await replayed(tmp_path) == expected


# --- replay in bounded memory ---


async def test_replay_streams_a_segment_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 MiB of journal, almost all of it sessions since collected and
    forgotten: replay holds one read window at a time, not the file."""
    rng = np.random.default_rng(3)
    async with running(tmp_path) as (journal, _):
        kept = new_session("kept")
        journal.create(kept)
        do_turn(journal, kept, rng)
        for i in range(30):
            gone = new_session(f"gone{i}")
            journal.create(gone)
            do_turn(journal, gone, rng, prompt=50_000, sampled=50_000)
            journal.close(gone.id)
        await journal.wait_durable()
        expected = states([kept])
    size = segment(tmp_path).stat().st_size
    assert size > 16 << 20
    reads: list[int] = []
    pread = os.pread

    def counted(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", counted)
    tracemalloc.start()
    try:
        found = recover(tmp_path, NOW, 1.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        monkeypatch.undo()
    os.close(found.fd)
    os.close(found.lock_fd)
    assert states(found.sessions) == expected
    largest = 12 + 4 * 50_000 + 8 * 50_000 + 4096  # one of those turn records, about
    assert max(reads) <= max(reader.READ_BYTES, largest)
    assert sum(reads) < 2 * size  # each byte read at most about twice (windows overlap)
    assert peak < 2 * max(reader.READ_BYTES, largest) + (1 << 20)  # vs the 16 MiB segment


# --- damage ---


def flip_blob_byte(data: bytearray, record: reader.Record) -> None:
    data[record.offset + record.size - 1] ^= 0x40


def length_past_the_end(data: bytearray, record: reader.Record) -> None:
    fmt.HEADER.pack_into(data, record.offset, len(data), 0)


def length_within(data: bytearray, record: reader.Record) -> None:
    # Claims the next records too (its crc no longer matches what it covers).
    size, crc = fmt.HEADER.unpack_from(data, record.offset)
    fmt.HEADER.pack_into(data, record.offset, size + 3000, crc)


def zero_header_and_meta(data: bytearray, record: reader.Record) -> None:
    # Its session cannot be read from it: found by its next record not applying.
    data[record.offset : record.offset + 64] = bytes(64)


DAMAGE = {
    "crc": flip_blob_byte,
    "length-past-the-end": length_past_the_end,
    "length-within": length_within,
    "zeroed-meta": zero_header_and_meta,
}


@pytest.mark.parametrize("how", list(DAMAGE), ids=list(DAMAGE))
async def test_damage_in_the_middle_costs_only_its_records(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    rng = np.random.default_rng(4)
    async with running(tmp_path) as (journal, _):
        sessions = [new_session(f"s{i}") for i in range(5)]
        for s in sessions:
            journal.create(s)
        for _ in range(4):  # interleaved: every session has records after the damage
            for s in sessions:
                do_turn(journal, s, rng)
        await journal.wait_durable()
        expected = states(sessions)
    path = segment(tmp_path)
    data = bytearray(path.read_bytes())
    records: list[reader.Record] = []
    reader.scan(bytes(data), records.append)
    victim = next(r for r in records[6 + 5 :] if r.meta["id"] == "s2")  # s2's 2nd turn
    DAMAGE[how](data, victim)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        got = await replayed(tmp_path)
    del expected["s2"]
    assert got == expected  # every other session, every one of its turns
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(f"offset {victim.offset}" in m for m in errors), errors
    assert any("dropping session s2" in m for m in errors), errors
    assert (tmp_path / f"{path.name}.bad-{victim.offset}").exists()
    # The damage is left behind: start-up rewrote the segment without it.
    caplog.clear()
    assert await replayed(tmp_path) == expected
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --- live sessions are compacted ---


async def test_turns_a_rollback_superseded_are_reclaimed(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    async with running(tmp_path, compact_min_dead_bytes=200_000) as (journal, _):
        s = new_session("retried")
        journal.create(s)
        for _ in range(40):  # one live session whose first turn is retried over and over
            do_turn(journal, s, rng, keep=0, prompt=2000, sampled=2000)
            await journal.wait_durable()
        stats = journal.stats()
        expected = states([s])
    # 40 turn records of ~24 KB were written; the journal holds about one.
    assert stats.compactions >= 1
    assert stats.bytes < 200_000 + 2 * 24_000
    assert await replayed(tmp_path) == expected
