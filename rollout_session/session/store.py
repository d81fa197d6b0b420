"""The session store: the one owner of every session life-cycle change.

Create, commit (a turn), expire, close (collect), forget and restore each
change the registry, the worker pin and the journal together, here and
nowhere else. Each change is plain synchronous code that first checks that
the journal can record it, then changes memory and enqueues the journal
record in the same step (no ``await`` in between, the journal's contract).
So a journal that cannot write changes nothing: the request gets 503
``journal_unavailable`` and the session stays as it was. Awaiting durability
comes after the step; a create, a turn or a collection the journal fails to
make durable meanwhile is undone before anyone is answered. Nothing is
acknowledged, or forgotten, unless it is durable; the journal writes again
by itself once it can (`Journal`), and changes are taken again from then on.

A close, once begun, runs to the end whatever its DELETE's client does: the
wait for the in-flight turn and the journal write are shielded from the
request's cancellation, so a session never stays ``closing``. A collected
session stays readable (and a repeated DELETE answers with the same
document) until the reaper forgets it after ``--keep-collected-s``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..errors import JournalUnavailable
from .commit import CommitUndo, Sampled, TurnPlan, commit_turn
from .journal.format import JournalError
from .session import Session, SessionRegistry, SessionState, TurnSlot
from .trajectory import Turn

if TYPE_CHECKING:
    from .journal.writer import Journal

__all__ = ["JournalOptions", "SessionEngine", "SessionStore"]

logger = logging.getLogger("rollout_session")


def _unavailable() -> JournalUnavailable:
    return JournalUnavailable(
        "the session journal cannot record changes now (a write failed); nothing was "
        "changed. Reads still answer; changes are taken again once the journal writes again"
    )


class SessionEngine(Protocol):
    """The engine's side of a session's life: it pins the session to a worker
    and may keep state for it (`engines.base.Engine` is one)."""

    def adopt(self, session: Session) -> None:
        """Take back a session restored from the journal with its pin."""

    def release(self, session: Session) -> None:
        """The session takes no more turns: drop its pin and engine state."""


@dataclass(frozen=True, kw_only=True)
class JournalOptions:
    """``--journal DIR`` and its write policy (docs/reliability.md#durable-journal);
    built by `Settings.journal_options`, where the defaults are."""

    directory: Path
    fsync: str  # always | interval | never
    fsync_interval_s: float
    retry_s: float  # after a failed write; backs off to 30 s


class SessionStore:
    """Sessions of one server: lookups through `registry`, changes through here."""

    def __init__(self, registry: SessionRegistry, engine: SessionEngine | None = None) -> None:
        self.registry = registry
        # The engine the sessions' pins are kept by; attached at start-up once
        # it is chosen (`attach`): nothing is released before.
        self._engine = engine
        # Attached by `open_journal` at start-up with --journal; None: memory only.
        self.journal: Journal | None = None
        # Closes under way, by session id: a repeated DELETE waits for its end.
        self._closes: dict[str, trio.Event] = {}

    @property
    def clock(self) -> Callable[[], float]:
        return self.registry.clock

    @property
    def writable(self) -> bool:
        """Whether a change now could be journaled (always, without a journal)."""
        return self.journal is None or self.journal.writable

    def _check_writable(self) -> None:
        if not self.writable:
            raise _unavailable()

    # --- start-up and shutdown ---

    async def open_journal(self, options: JournalOptions | None) -> None:
        """Replay ``--journal`` and take back its sessions; once per store.

        `cli.serve` calls it before the listener opens, so replay has no
        start-up limit (the app's lifespan has hypercorn's); an app started
        otherwise (tests, embedding) calls it from its start-up."""
        if options is None or self.journal is not None:
            return
        from .journal.writer import Journal

        journal, restored = await Journal.open(
            options.directory,
            fsync=options.fsync,
            fsync_interval_s=options.fsync_interval_s,
            retry_s=options.retry_s,
            now=self.clock(),
        )
        self.restore(journal, restored)
        logger.info("journal %s: restored %d sessions", options.directory, len(restored))

    def restore(self, journal: Journal, sessions: list[Session]) -> None:
        """Attach the journal just opened and take back the sessions it replayed
        (no caps: they existed), with their worker pins (the engine takes
        them back now, or when it is attached)."""
        self.journal = journal
        for session in sessions:
            self.registry.restore(session)
            if self._engine is not None:
                self._engine.adopt(session)

    def attach(self, engine: SessionEngine) -> None:
        """The engine chosen at start-up: it takes back every session held
        so far (those the journal restored) with its pin."""
        self._engine = engine
        for session in self.registry:
            engine.adopt(session)

    @property
    def engine(self) -> SessionEngine:
        if self._engine is None:
            raise RuntimeError("session store used before start-up attached its engine")
        return self._engine

    async def run_journal(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Run the journal's writer for the app's lifetime.

        A failed write is the writer's to recover from (changes answer 503
        ``journal_unavailable`` meanwhile). A writer that dies (a bug) is
        logged here, once, not raised: raised, it would cancel the app's
        other tasks (health probes, the reaper) with it; changes answer 503
        from then on, and `/ready` says why.
        """
        if self.journal is None:
            task_status.started()
            return
        try:
            await self.journal.run(task_status=task_status)
        except Exception:
            logger.exception(
                "journal writer failed: sessions take no more changes (503 journal_unavailable) "
                "until the server restarts"
            )

    async def aclose(self) -> None:
        """Flush and close the journal. A writer failure reported already by
        `run_journal` is not raised again."""
        journal = self.journal
        if journal is None:
            return
        failed = not journal.writable
        try:
            await journal.aclose()
        except JournalError:
            if not failed:
                raise

    # --- life-cycle changes ---

    async def create(
        self,
        session_id: str | None,
        *,
        metadata: dict[str, Any] | None,
        ttl_s: float | None,
        priority: int | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> Session:
        """A new session, answered once it is durable. An id held by a
        collected session is taken over: that session is forgotten."""
        self._check_writable()
        held = self.registry.find(session_id)
        replacing = held if held is not None and held.state is SessionState.COLLECTED else None
        session = self.registry.create(
            session_id,
            metadata=metadata,
            ttl_s=ttl_s,
            priority=priority,
            sampling=sampling,
            replacing=replacing,
        )
        journal = self.journal
        if journal is not None:
            if replacing is not None:
                journal.close(replacing.id)
            journal.create(session)
            try:
                # Shielded: whatever the client does, a create that did not
                # become durable is removed here (the journal dropped it).
                with trio.CancelScope(shield=True):
                    await journal.wait_durable()
            except JournalError as exc:
                self.registry.remove(session)
                if replacing is not None:  # nothing half-done: it is back
                    self.registry.restore(replacing)
                    journal.reinstate(replacing)
                raise _unavailable() from exc
        return session

    def claim(self, session: Session) -> TurnSlot:
        """Take the session's turn slot (`Session.claim`), refusing at once a
        turn the journal could not record: the worker never sees it."""
        self._check_writable()
        return session.claim(self.clock())

    async def commit(
        self,
        session: Session,
        slot: TurnSlot,
        plan: TurnPlan,
        sampled: Sampled,
    ) -> Turn:
        """Commit a validated turn; return once it is durable.

        The agent hears of a turn only then. The wait is shielded: a close
        arriving meanwhile waits for this (bounded) write rather than cut it
        short. If the journal fails before the turn is durable, the turn is
        undone (the slot is still held: no other turn touched the trajectory).
        """
        self._check_writable()
        journal = self.journal
        if journal is None:
            return commit_turn(session, slot, plan, sampled, self.clock())
        undo = CommitUndo.before(session, plan)
        turn = commit_turn(session, slot, plan, sampled, self.clock())
        journal.turn(
            session,
            sampled.experts,
            new_segment=plan.branch is not None,
            rolled_back=plan.branch is None and plan.rollback is not None,
        )
        try:
            with trio.CancelScope(shield=True):
                await journal.wait_durable()
        except JournalError as exc:
            undo.apply(session)
            raise _unavailable() from exc
        return turn

    def expire(self, session: Session) -> None:
        """Close a session on the server's own initiative: no more turns (the
        in-flight one is cancelled), unpinned, readable until collected."""
        self._check_writable()
        session.expire(self.clock())
        self._unpin(session)
        if self.journal is not None:
            self.journal.expire(session)

    async def close(self, session_id: str) -> Session:
        """Collect a session (DELETE): cancel its in-flight turn, wait for it,
        mark the session collected durably, and return it for its document.

        Repeatable: a session already collected is returned as it is (the
        same document), and a DELETE arriving while another is collecting
        the session waits for that one's outcome.

        Once begun, the close is shielded from the caller's cancellation: a
        DELETE whose client goes away may lose its answer, but the session
        still ends collected and journaled (and the retry gets the document).

        If the journal cannot record the collection, the session is put back
        as it was (the cancelled turn stays uncommitted, as after any failed
        turn) and the caller gets 503: nothing is collected unless it is
        durable.
        """
        while True:
            session = self.registry.get(session_id)
            if session.state is SessionState.COLLECTED:
                return session
            under_way = self._closes.get(session.id)
            if under_way is None:
                break
            await under_way.wait()
        self._check_writable()
        done = self._closes[session.id] = trio.Event()
        try:
            with trio.CancelScope(shield=True):
                await self._collect(session)
        finally:
            del self._closes[session.id]
            done.set()
        return session

    async def _collect(self, session: Session) -> None:
        before = session.state, session.closed_at
        slot = session.begin_close(self.clock())
        journal = self.journal
        if journal is not None and before[0] is SessionState.OPEN:
            # Collection has begun: a restart brings the session back expired
            # (readable, collectable), never open for more turns.
            journal.closing(session)
        if slot is not None:
            # The turn runs inside slot.cancel_scope: it aborts its upstream
            # request and commits nothing.
            await slot.done.wait()
        if journal is not None and not journal.writable:
            session.state, session.closed_at = before
            raise _unavailable()
        self.registry.collect(session)
        if journal is not None:
            journal.collect(session)
            try:
                await journal.wait_durable()
            except JournalError as exc:
                self.registry.uncollect(session, *before)
                raise _unavailable() from exc
        self._unpin(session)

    def forget(self, session: Session) -> None:
        """Drop a session the server closed or a DELETE collected, its keep
        window over."""
        self._check_writable()
        self._remove(session)
        if self.journal is not None:
            self.journal.close(session.id)

    def _remove(self, session: Session) -> None:
        self.registry.remove(session)
        self._unpin(session)

    def _unpin(self, session: Session) -> None:
        """Release the session's pin, remembering the worker (`last_worker`:
        a closed session's rescore ``pinned`` goes there)."""
        if session.worker is not None:
            session.last_worker = session.worker
        self.engine.release(session)
