"""Opening a journal directory: ownership, crash leftovers, and replay.

Owns what happens before the journal accepts events, in a worker thread:
taking the directory's ``LOCK`` (flock: a second process is refused, not
interleaved), deleting what a crash left behind (an unfinished ``.tmp``
segment, segments a finished compaction superseded; an empty newest segment
is set aside), replaying the newest
segment into sessions (streamed: memory is the sessions it restores plus one
read window), and counting its live and dead bytes so the journal can decide
at once whether to append to it or compact first (also when damage was
skipped in its middle: the rewrite leaves it behind). The segment rules are
in `format`, reading them in `reader`; what the records
mean, in `records`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..session import Session
from .format import JournalError, segments
from .reader import replay_segment
from .records import Replay, TurnBytes

__all__ = ["Recovered", "recover"]

# The journal's one logger, whichever of its modules speaks.
logger = logging.getLogger("rollout_session.journal")


@dataclass(frozen=True, slots=True)
class Recovered:
    """A directory as found at start; the journal takes over its fds."""

    lock_fd: int  # holds the flock for as long as it is open
    segment: int  # number of the newest segment (0: none yet)
    fd: int  # append fd of that segment, or -1: compact before appending
    sessions: list[Session]  # restored, creation order
    live_bytes: dict[str, int]  # per restored session, its bytes in the segment
    turn_bytes: dict[str, TurnBytes]  # per restored session, its turn records in effect
    dead_bytes: int  # bytes of forgotten or unreadable sessions, superseded records
    total_bytes: int  # good size of the segment
    records: int  # replayed


def _without_empty_newest(found: list[tuple[int, Path]]) -> list[tuple[int, Path]]:
    """Set aside empty newest segments: one holds no record (nothing written
    to it reached the disk: a crash between creating it and writing its
    header), so the one before it, if any, is the journal. Kept as
    ``….log.empty`` for a post-mortem; logged, never silent."""
    while found and found[-1][1].stat().st_size == 0:
        _, empty = found.pop()
        aside = empty.with_name(empty.name + ".empty")
        empty.rename(aside)
        logger.warning(
            "journal: %s is empty (a crash before anything was written to it): set aside as %s; %s",
            empty,
            aside.name,
            f"replaying {found[-1][1].name}" if found else "no older segment: no sessions",
        )
    return found


def recover(directory: Path, now: float, compact_dead_ratio: float) -> Recovered:
    """Lock DIR (created if missing), clean it up and replay it. Sessions'
    ``last_active_at`` is ``now``. No append fd when there is no segment,
    dead bytes are over `compact_dead_ratio` of it, or damage was skipped in
    its middle: compaction writes the next one."""
    directory.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JournalError(f"journal {directory} is in use by another process") from None
        for tmp in directory.glob("journal-*.log.tmp"):
            logger.warning("journal: removing unfinished compaction %s", tmp)
            tmp.unlink()
        replay = Replay(now)
        found = _without_empty_newest(segments(directory))
        number = total = 0
        damaged = False
        started = time.perf_counter()
        if found:
            number, path = found[-1]
            total, damaged = replay_segment(path, number, replay.apply, replay.damaged)
        sessions = replay.finish()
        logger.info(
            "journal %s: replayed %d records (%d bytes) into %d sessions in %.1f s",
            directory,
            replay.records,
            total,
            len(sessions),
            time.perf_counter() - started,
        )
        dead = replay.dead_bytes
        fd = -1
        if found and not damaged and dead <= compact_dead_ratio * total:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            for _, older in found[:-1]:  # a compaction's crash leftovers
                logger.info("journal: removing superseded segment %s", older)
                older.unlink()
        return Recovered(
            lock_fd,
            number,
            fd,
            sessions,
            replay.live_bytes,
            replay.turn_bytes,
            dead,
            total,
            replay.records,
        )
    except BaseException:
        os.close(lock_fd)
        raise
