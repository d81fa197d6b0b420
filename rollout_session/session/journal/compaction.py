"""Compaction's output: a new segment holding a snapshot of every live session.

Owns writing that segment beside the live one (as ``….log.tmp``, then
installed by `format.install_segment`) while the event loop keeps
running, and the bookkeeping that lets the journal's writer switch over
without losing or duplicating a record. When to compact, and flushing the
queue into the old segment first, stay with the writer in `journal`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import trio

from ..session import Session
from .format import begin_meta, encode, framed_size, install_segment, segment_name, write_records
from .records import snapshot_parts

__all__ = ["Compacted", "write_compacted"]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


@dataclass(frozen=True, slots=True)
class Compacted:
    """A new segment, installed: the live one from now on."""

    fd: int  # append fd of it
    live_bytes: dict[str, int]  # per session, the framed size of its snapshot
    turns: dict[str, int]  # per session, the turns its snapshot holds
    total_bytes: int
    # Per session, the last queued record its snapshot already holds (or,
    # for a session closed meanwhile, the last one that no longer matters).
    skip_upto: dict[str, int]


async def write_compacted(
    directory: Path,
    number: int,
    sessions: Mapping[str, Session],
    last_seq: Callable[[], int],
    max_batch_bytes: int,
) -> Compacted:
    """Write segment `number` from `sessions` (the journal's live map, read
    as it changes) and install it; `last_seq` is the journal's last enqueued
    record. A failure leaves no ``.tmp`` behind and the live segment as it was."""
    tmp = directory / f"{segment_name(number)}.tmp"
    try:
        fd = await trio.to_thread.run_sync(os.open, tmp, _CREATE, 0o644)
        try:
            live, turns, total, skip = await _write_snapshots(
                fd, number, sessions, last_seq, max_batch_bytes
            )
        finally:
            os.close(fd)
        new_fd = await trio.to_thread.run_sync(install_segment, directory, number, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Compacted(new_fd, live, turns, total, skip)


async def _write_snapshots(
    fd: int,
    number: int,
    sessions: Mapping[str, Session],
    last_seq: Callable[[], int],
    max_batch_bytes: int,
) -> tuple[dict[str, int], dict[str, int], int, dict[str, int]]:
    """Write the begin record and a snapshot per live session, fsync.

    Each session is copied on the loop in one synchronous step, so its
    snapshot holds every record enqueued for it so far: the returned skip
    map says which queued records are covered (or of sessions gone)."""
    chunk = [encode(begin_meta(number))]
    total = unwritten = framed_size(chunk[0])
    live: dict[str, int] = {}
    turns: dict[str, int] = {}
    skip: dict[str, int] = {}
    for sid in list(sessions):
        session = sessions.get(sid)
        if session is not None:  # else closed meanwhile: dropped
            chunk.append(snapshot_parts(session))
            live[sid] = framed_size(chunk[-1])
            turns[sid] = len(session.trajectory.turns)
            total += live[sid]
            unwritten += live[sid]
        skip[sid] = last_seq()
        if unwritten >= max_batch_bytes:
            await trio.to_thread.run_sync(write_records, fd, chunk, False)
            chunk, unwritten = [], 0
        else:  # one session's copy per step keeps the loop responsive
            await trio.lowlevel.checkpoint()
    await trio.to_thread.run_sync(write_records, fd, chunk, True)
    return live, turns, total, skip
