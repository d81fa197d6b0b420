"""Durable journal of session events (opt-in ``--journal DIR``).

Owns the journal of a running server: the events of journaled sessions
(`create`, `turn`, `expire`, `closing`, `collect`, `close`), making them
durable off the event loop (`run`, `wait_durable`), deciding when to compact
and switching to the compacted segment, recovering from a failed write, and
`aclose`. Opening a directory (lock, leftovers, replay) is
`recovery`; writing a compacted segment, `compaction`; the
records, `records`; the files and their framing, `format`;
reading them back, `reader`.

Contract with the caller (the session store): every in-memory change of a
journaled session is reported right after it happens, with no ``await`` in
between, and only while `writable`. The event calls only encode the delta and
enqueue it (O(new tokens)); one writer task batches records, frames them
(crc32) and appends them with ``os.writev`` in a worker thread. So the
files plus the queue always replay to exactly the in-memory state: compaction
can snapshot a live session at any moment and skip the queued records that
snapshot already covers.

A failed write (a full disk, an I/O error) loses the records not yet
written: their `wait_durable` raises, and the caller undoes what they
recorded before anyone hears of it (a create the journal drops here itself).
Until the journal writes again it takes no events (`writable` is false).
The writer retries, backing off from `retry_s` to `retry_max_s`: it cuts the
segment back to its last whole record and appends, for each session a lost
record touched, a snapshot of what memory now holds (or its ``close``), so
the files again replay to memory; after a failed fsync (what is on disk is
then unknown) it rewrites every session into a new segment instead. Once
that is durable, events are taken again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import trio

from ..session import Session
from . import format as fmt
from . import records
from .compaction import write_compacted
from .format import InstallFailed, JournalError, Parts, SyncFailed, framed_size, write_records
from .records import TurnBytes
from .recovery import Recovered, recover

__all__ = ["FSYNC_POLICIES", "Journal", "JournalError", "JournalStats"]

logger = logging.getLogger("rollout_session.journal")

FSYNC_POLICIES = frozenset({"always", "interval", "never"})


@dataclass(frozen=True, slots=True)
class _Options:
    fsync: str
    fsync_interval_s: float
    compact_dead_ratio: float
    compact_min_dead_bytes: int
    max_batch_bytes: int
    retry_s: float
    retry_max_s: float


@dataclass(frozen=True, slots=True)
class JournalStats:
    segment: int
    bytes: int  # size of the current segment
    dead_bytes: int  # of it, records superseded (forgotten sessions, rolled-back turns)
    sessions: int
    records_written: int
    fsyncs: int
    compactions: int
    write_failures: int  # failed writes or fsyncs (each recovered from, or not yet)


@dataclass(slots=True)
class _Pending:
    seq: int
    session_id: str
    parts: Parts
    size: int  # framed
    enqueued_at: float  # time.monotonic()
    kind: str  # the record type
    turns: int = 0  # a turn record: the turns it keeps (its index)


class Journal:
    """The journal of one server. Build it with `Journal.open`."""

    def __init__(self, directory: Path, options: _Options, found: Recovered) -> None:
        self.directory = directory
        self._options = options
        self._lock_fd = found.lock_fd
        self._fd = found.fd  # append fd of the current segment (-1: none yet)
        self._segment = found.segment
        # Journaled sessions still in the registry: what compaction snapshots.
        self._sessions = {s.id: s for s in found.sessions}
        self._live_bytes = found.live_bytes
        self._turn_bytes = found.turn_bytes
        self._dead_bytes = found.dead_bytes
        self._total_bytes = found.total_bytes  # every byte up to it is a whole record
        self._pending: deque[_Pending] = deque()
        self._inflight: list[_Pending] = []
        self._seq = 0  # last enqueued
        self._written_seq = 0  # every record up to it is in the OS
        self._synced_seq = 0  # ... and on disk
        # After a compaction: records of a session up to this seq are already
        # in the new segment's snapshot (or the session is gone): skip them.
        self._skip_upto: dict[str, int] = {}
        self._wake = trio.Event()
        self._progress = trio.Event()
        self._stopped = trio.Event()
        self._unsynced = False
        self._last_sync = -math.inf
        self._running = self._closing = self._closed = False
        self._compact_requested = self._compacting = False
        self._compact_not_before = -math.inf  # after a failed compaction
        self._compact_attempts = 0
        self._compact_error: BaseException | None = None  # of the last attempt
        # Set while the journal takes no events: a write failed (cleared once
        # it writes again) or the writer died (for good).
        self._failure: BaseException | None = None
        # The durable seq at each failure: records past it, enqueued before
        # it, were lost (their `wait_durable` raises).
        self._losses: list[int] = []
        # Sessions a lost record touched: recovery writes their state again.
        self._touched: dict[str, None] = {}
        self._rewrite_all = False  # an fsync failed: recovery rewrites every session
        self._waiting = 0  # tasks inside `wait_durable`
        self._quiet: trio.Event | None = None  # set when `_waiting` drops to 0
        self._records_written = self._fsyncs = self._compactions = self._write_failures = 0

    # --- opening ---

    @classmethod
    async def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        fsync: str = "interval",
        fsync_interval_s: float = 1.0,
        compact_dead_ratio: float = 0.5,
        compact_min_dead_bytes: int = 64 << 20,
        max_batch_bytes: int = 16 << 20,
        retry_s: float = 1.0,
        retry_max_s: float = 30.0,
        now: float | None = None,
    ) -> tuple[Journal, list[Session]]:
        """Open (or create) DIR, replay it, and return the journal plus every
        session it restores (creation order) for the registry. Restored
        sessions are open, expired or collected; their ``last_active_at`` is
        ``now`` (downtime is not idleness). Replay runs in a worker thread
        and streams the segment; then, if superseded records hold over
        `compact_dead_ratio` of the bytes or damage was skipped, the journal
        is compacted before it is returned (if that fails for want of room,
        it appends to the segment it replayed)."""
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {sorted(FSYNC_POLICIES)}, got {fsync!r}")
        options = _Options(
            fsync,
            fsync_interval_s,
            compact_dead_ratio,
            compact_min_dead_bytes,
            max_batch_bytes,
            retry_s,
            max(retry_s, retry_max_s),
        )
        at = time.time() if now is None else now
        found = await trio.to_thread.run_sync(recover, Path(directory), at, compact_dead_ratio)
        try:
            self = cls(Path(directory), options, found)
            if self._fd < 0:  # no segment to append to, or worth compacting
                try:
                    await self._snapshot_segment()
                except InstallFailed:
                    raise  # the new segment may be the live one: appending would be lost
                except OSError:
                    if not found.segment:
                        raise
                    logger.warning(
                        "journal %s: compaction at start-up failed; appending to %s",
                        directory,
                        fmt.segment_name(found.segment),
                        exc_info=True,
                    )
                    path = self.directory / fmt.segment_name(found.segment)
                    self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except BaseException:
            os.close(found.lock_fd)
            raise
        return self, found.sessions

    # --- events (synchronous, on the event loop, right after the change) ---

    def create(self, session: Session) -> None:
        if session.id in self._sessions:
            raise JournalError(f"session {session.id} is journaled already")
        self._enqueue(session.id, fmt.encode(records.create_meta(session)), "create")
        self._sessions[session.id] = session

    def turn(
        self,
        session: Session,
        experts: tuple[bytes, int] | None = None,
        *,
        new_segment: bool = False,
        rolled_back: bool = False,
    ) -> None:
        """Record the turn `commit_turn` just applied, as a delta: O(new tokens).
        `experts` is what was passed to it (None when no routed experts);
        `new_segment` / `rolled_back`: whether it started a segment or
        replaced turns."""
        self._known(session)
        parts = records.turn_parts(
            session,
            experts[0] if experts else None,
            new_segment=new_segment,
            rolled_back=rolled_back,
        )
        kind = "segment" if new_segment else "turn"
        self._enqueue(session.id, parts, kind, session.trajectory.turns[-1].index)

    def expire(self, session: Session) -> None:
        """The server closed the session; replay restores it as expired."""
        self._known(session)
        meta = {
            "t": "expire",
            "id": session.id,
            "cl": session.closed_at,
            "worker": session.worker,
            "lw": session.worker or session.last_worker,
        }
        self._enqueue(session.id, fmt.encode(meta), "expire")

    def closing(self, session: Session) -> None:
        """A DELETE began collecting the open session. Recorded as an expiry
        (unpinned; ``why`` only tells them apart in a post-mortem): a restart
        before the collection is journaled brings the session back closed
        but readable, never open for more turns."""
        self._known(session)
        meta = {
            "t": "expire",
            "id": session.id,
            "cl": session.closed_at,
            "worker": None,
            "lw": session.worker or session.last_worker,
            "why": "close",
        }
        self._enqueue(session.id, fmt.encode(meta), "expire")

    def collect(self, session: Session) -> None:
        """A DELETE collected the session: replay restores it collected
        (readable, unpinned) until `close` forgets it."""
        self._known(session)
        meta = {
            "t": "collect",
            "id": session.id,
            "cl": session.closed_at,
            # The worker it was pinned to (or last, if it expired first).
            "lw": session.worker or session.last_worker,
        }
        self._enqueue(session.id, fmt.encode(meta), "collect")

    def close(self, session_id: str) -> None:
        """The session is forgotten (its keep window over, or dropped): replay
        forgets it."""
        if session_id in self._sessions:
            self._enqueue(session_id, fmt.encode({"t": "close", "id": session_id}), "close")
            del self._sessions[session_id]

    def reinstate(self, session: Session) -> None:
        """Undo `close` of a session whose ``close`` record was lost with a
        failed write (its caller put it back in memory): journaled again, its
        state is written by the recovery like any other touched session's."""
        if self._failure is None or session.id not in self._touched:
            raise JournalError(f"the close of session {session.id} was not lost")
        self._sessions[session.id] = session

    def _known(self, session: Session) -> None:
        if self._sessions.get(session.id) is not session:
            raise JournalError(f"session {session.id} was not journaled")

    def _enqueue(self, session_id: str, parts: Parts, kind: str, turns: int = 0) -> None:
        self._check()
        if self._closing:
            raise JournalError("journal is closed")
        self._seq += 1
        size = framed_size(parts)
        self._pending.append(
            _Pending(self._seq, session_id, parts, size, time.monotonic(), kind, turns)
        )
        self._wake.set()

    # --- durability ---

    async def wait_durable(self) -> None:
        """Return once every record enqueued before the call is written.

        With fsync ``always`` that means on disk (fsynced, group-committed per
        batch). With ``interval``/``never`` it means handed to the OS: it
        survives the process dying (kill -9) but not a power loss or kernel
        crash; ``interval`` bounds that window to `fsync_interval_s`.
        Raises `JournalError` if a write failed before they were: the
        caller undoes what they recorded (the journal will not write them).
        """
        target = self._seq
        epoch = len(self._losses)
        self._waiting += 1
        try:
            while True:
                if len(self._losses) > epoch:  # a write failed since the call
                    if target > self._losses[epoch]:
                        raise JournalError(
                            "the journal failed before this change was durable"
                        ) from self._failure
                    return
                if self._durable_seq >= target:
                    return
                self._check()
                if self._closed:
                    raise JournalError("journal is closed")
                await self._progress.wait()
        finally:
            self._waiting -= 1
            if not self._waiting and self._quiet is not None:
                self._quiet.set()

    @property
    def _durable_seq(self) -> int:
        return self._synced_seq if self._options.fsync == "always" else self._written_seq

    async def wait_writable(self) -> None:
        """Return once the journal takes events (at once if it does);
        `JournalError` if it never will again (closed, or its writer died)."""
        while not self.writable:
            if self._closing or self._closed or not self._running:
                raise JournalError("the journal is closed or its writer is not running")
            await self._progress.wait()

    def lag(self) -> tuple[int, float]:
        """For metrics: (records not yet durable in the `wait_durable` sense,
        age in seconds of the oldest of them)."""
        count = len(self._inflight) + len(self._pending)
        if not count:
            return 0, 0.0
        first = self._inflight[0] if self._inflight else self._pending[0]
        return count, time.monotonic() - first.enqueued_at

    def stats(self) -> JournalStats:
        return JournalStats(
            self._segment,
            self._total_bytes,
            self._dead_bytes,
            len(self._sessions),
            self._records_written,
            self._fsyncs,
            self._compactions,
            self._write_failures,
        )

    @property
    def writable(self) -> bool:
        """Whether an event reported now can be written: false from a failed
        write until the journal has written again (the writer retries by
        itself), for good once its writer died, and once closing."""
        return self._failure is None and not self._closing

    def _check(self) -> None:
        if self._failure is not None:
            raise JournalError("the journal cannot write now") from self._failure

    def _notify(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    # --- the writer task ---

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The single writer. Returns after `aclose`; on cancellation it still
        flushes and fsyncs (shielded). A failed write or fsync (an `OSError`)
        is recovered from here (see the module); anything else is a bug: it
        is raised here, and the journal takes no events from then on."""
        if self._running or self._closed:
            raise RuntimeError("Journal.run is already running or closed")
        self._running = True
        self._last_sync = trio.current_time()
        task_status.started()
        try:
            while not self._closing:
                try:
                    await self._write_forever()
                except OSError as exc:
                    self._lose(exc)
                    await self._recover()
        except BaseException as exc:
            if not isinstance(exc, trio.Cancelled):
                self._lose(exc)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self._shutdown()

    async def _write_forever(self) -> None:
        while True:
            self._wake = trio.Event()  # fresh before looking: no lost wake-up
            if self._compact_requested or self._compaction_due():
                await self._compact()
            elif self._pending:
                await self._write_batch()
            elif self._closing:
                return
            elif trio.current_time() < self._fsync_deadline():
                with trio.move_on_at(self._fsync_deadline()):
                    await self._wake.wait()
                continue
            # Checked after every batch too: steady load must not starve it.
            if trio.current_time() >= self._fsync_deadline():
                await self._fsync()

    def _compaction_due(self) -> bool:
        dead, options = self._dead_bytes, self._options
        return (
            dead > options.compact_min_dead_bytes
            and dead > options.compact_dead_ratio * self._total_bytes
            and trio.current_time() >= self._compact_not_before
        )

    def _fsync_deadline(self) -> float:
        if self._unsynced and self._options.fsync == "interval":
            return self._last_sync + self._options.fsync_interval_s
        return math.inf

    async def _write_batch(self) -> None:
        batch: list[_Pending] = []
        size = 0
        while self._pending and (
            not batch or size + self._pending[0].size <= self._options.max_batch_bytes
        ):
            batch.append(self._pending.popleft())
            size += batch[-1].size
        self._inflight = batch
        keep = [r for r in batch if r.seq > self._skip_upto.get(r.session_id, 0)]
        sync = self._options.fsync == "always"
        if keep:
            await trio.to_thread.run_sync(write_records, self._fd, [r.parts for r in keep], sync)
        self._inflight = []
        for rec in keep:
            self._count(rec.session_id, rec.kind, rec.size, rec.turns)
        self._records_written += len(keep)
        self._written_seq = batch[-1].seq
        if sync:
            self._fsyncs += bool(keep)
            self._synced_seq = self._written_seq
        elif keep:
            self._unsynced = True
        self._notify()

    def _count(self, session_id: str, kind: str, size: int, turns: int) -> None:
        """Account a record appended to the segment: live or dead bytes."""
        live = self._live_bytes
        self._total_bytes += size
        if kind == "close":
            self._dead_bytes += live.pop(session_id, 0) + size
            self._turn_bytes.pop(session_id, None)
            return
        if kind in ("create", "snapshot"):
            self._dead_bytes += live.pop(session_id, 0)  # a snapshot supersedes them
            self._turn_bytes[session_id] = TurnBytes(turns)
        elif kind in ("turn", "segment"):
            if kind == "segment":  # the earlier segments' turn records stay live
                self._turn_bytes[session_id] = TurnBytes()
            superseded = self._turn_bytes.setdefault(session_id, TurnBytes()).turn(turns, size)
            self._dead_bytes += superseded
            size -= superseded
        live[session_id] = live.get(session_id, 0) + size

    async def _fsync(self) -> None:
        upto = self._written_seq
        await trio.to_thread.run_sync(fmt.fsync, self._fd)
        self._fsyncs += 1
        self._synced_seq = max(self._synced_seq, upto)
        self._unsynced = self._written_seq > upto
        self._last_sync = trio.current_time()

    async def compact(self) -> None:
        """Ask the writer to compact now; return once a compaction that
        started after this call has finished (`JournalError` if it failed)."""
        target = self._compact_attempts + (2 if self._compacting else 1)
        self._compact_requested = True
        self._wake.set()
        while self._compact_attempts < target:
            self._check()
            if self._closed:
                raise JournalError("journal is closed")
            await self._progress.wait()
        if self._compact_error is not None:
            raise JournalError("the compaction failed") from self._compact_error

    async def _compact(self) -> None:
        """Rewrite the live sessions into a new segment, dropping the rest.
        Appends wait meanwhile (single writer). A failure to write the new
        segment leaves the current one as it was: it is logged, and
        compaction is not tried again for `retry_max_s`. A failure once the
        new segment is in place is a failed write (`InstallFailed`)."""
        self._compact_requested = False
        while self._pending:  # everything so far goes to the old segment first
            await self._write_batch()
        try:
            await self._snapshot_segment()
        except InstallFailed:
            raise  # a write failure: the journal recovers by writing a segment again
        except OSError as exc:
            self._compact_error = exc
            self._compact_not_before = trio.current_time() + self._options.retry_max_s
            logger.warning(
                "journal %s: compaction failed (%s); appending to %s meanwhile",
                self.directory,
                exc,
                fmt.segment_name(self._segment),
            )
        else:
            self._compact_error = None
        finally:
            self._compact_attempts += 1
            self._notify()

    async def _snapshot_segment(self) -> None:
        """Write the next segment from the sessions' state and switch to it;
        records queued meanwhile follow in it (those its snapshots hold are
        skipped)."""
        self._compacting = True
        try:
            covered = self._written_seq
            number = self._segment + 1
            new = await write_compacted(
                self.directory,
                number,
                self._sessions,
                lambda: self._seq,
                self._options.max_batch_bytes,
            )
            old, self._fd, self._segment = self._fd, new.fd, number
            if old >= 0:
                os.close(old)
            self._live_bytes, self._total_bytes = new.live_bytes, new.total_bytes
            self._turn_bytes = {sid: TurnBytes(n) for sid, n in new.turns.items()}
            self._dead_bytes = 0
            self._compactions += 1
            self._skip_upto = new.skip_upto
            self._synced_seq = max(self._synced_seq, covered)
            self._unsynced = False
            logger.info(
                "journal: compacted into %s (%d bytes)", fmt.segment_name(number), new.total_bytes
            )
        finally:
            self._compacting = False

    # --- failure and recovery ---

    def _lose(self, exc: BaseException) -> None:
        """A write failed (or the writer died): every record not yet durable
        is lost. Their waiters raise; the sessions they touched are written
        again by `_recover`."""
        if self._failure is not None and not isinstance(exc, OSError):
            self._failure = exc  # a recovery died: for good now
            self._notify()
            return
        lost = [*self._inflight, *self._pending]
        self._inflight = []
        self._pending.clear()
        self._losses.append(self._durable_seq)
        self._failure = exc
        self._write_failures += 1
        for rec in lost:
            self._touched[rec.session_id] = None
            if rec.kind == "create":
                # Never durable: the store forgets the session too.
                self._sessions.pop(rec.session_id, None)
        if isinstance(exc, SyncFailed):
            self._rewrite_all = True
        if self._fd >= 0:
            # Whole records of the failed batch may have reached the file:
            # cut them now, so that a crash before recovery replays no change
            # that was answered 503. (One syscall; recovery cuts again.)
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._total_bytes)
        if isinstance(exc, OSError):
            logger.error(
                "journal %s: a write failed (%s): %d records lost (their changes are undone "
                "and answered 503 journal_unavailable), and no change is taken until the "
                "journal writes again; retrying in %.1f s",
                self.directory,
                exc,
                len(lost),
                self._options.retry_s,
            )
        self._notify()

    async def _recover(self) -> None:
        """Until the journal writes again (or closes): wait, then write the
        state of what the lost records touched; back off on failure."""
        delay = self._options.retry_s
        failed_at = trio.current_time()
        while not self._closing:
            self._wake = trio.Event()
            with trio.move_on_after(delay):
                await self._wake.wait()  # only `aclose` sets it meanwhile
            if self._closing:
                return
            # Every waiter of a lost record has raised, and its caller has
            # undone the change (synchronously): memory is what to write.
            while self._waiting:
                self._quiet = trio.Event()
                await self._quiet.wait()
            try:
                if self._rewrite_all:
                    await self._snapshot_segment()
                else:
                    await self._rewrite_touched()
            except OSError as exc:
                self._write_failures += 1
                delay = min(delay * 2, self._options.retry_max_s)
                logger.warning(
                    "journal %s: still cannot write (%s); next try in %.1f s",
                    self.directory,
                    exc,
                    delay,
                )
                continue
            self._touched.clear()
            self._rewrite_all = False
            # Nothing was enqueued meanwhile: what was written covers all.
            self._written_seq = self._synced_seq = self._seq
            self._failure = None
            logger.warning(
                "journal %s: writing again after %.1f s; changes are taken again",
                self.directory,
                trio.current_time() - failed_at,
            )
            self._notify()
            return

    async def _rewrite_touched(self) -> None:
        """Cut the segment back to its last whole record, then append the
        current state of every session a lost record touched (a snapshot, or
        its ``close`` if it is gone) and fsync."""
        touched: list[tuple[str, str, int, Parts]] = []
        for sid in self._touched:
            session = self._sessions.get(sid)
            if session is None:
                touched.append((sid, "close", 0, fmt.encode({"t": "close", "id": sid})))
            else:
                turns = len(session.trajectory.turns)
                touched.append((sid, "snapshot", turns, records.snapshot_parts(session)))
        good, fd = self._total_bytes, self._fd

        def write() -> None:
            os.ftruncate(fd, good)
            write_records(fd, [parts for *_, parts in touched], True)

        await trio.to_thread.run_sync(write)
        for sid, kind, turns, parts in touched:
            self._count(sid, kind, framed_size(parts), turns)
        self._records_written += len(touched)
        self._fsyncs += 1
        self._unsynced = False

    # --- shutdown ---

    async def aclose(self) -> None:
        """Flush and fsync everything, stop the writer, release the directory."""
        self._closing = True
        if self._running:
            self._wake.set()
            await self._stopped.wait()
        elif not self._closed:
            await self._shutdown()
        self._check()

    async def _shutdown(self) -> None:
        self._closing = True
        try:
            if self._failure is None and self._fd >= 0:
                while self._pending:
                    await self._write_batch()
                await self._fsync()
        except BaseException as exc:
            self._failure = self._failure or exc
            raise
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._closed = True
            self._running = False
            self._stopped.set()
            self._notify()
