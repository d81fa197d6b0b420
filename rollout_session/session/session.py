"""Sessions: their life-cycle state, the one-turn-in-flight gate, the registry.

Every state change here is plain synchronous code. A check and the set that
depends on it never have an ``await`` between them, so two requests racing
for the same session are ordered by the event loop: one claims the slot, the
other sees it taken (409) — the worker never sees the loser.
"""

from __future__ import annotations

import enum
import itertools
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import trio
from sortedcontainers import SortedDict

from ..errors import (
    ClientError,
    InvalidRequest,
    SessionBusy,
    SessionClosing,
    SessionExists,
    SessionNotFound,
    TooManySessions,
)
from ..prompt.messages import Message
from .conversation import Conversation
from .segments import Branch, Rollback, Segment
from .trajectory import Trajectory

__all__ = ["Session", "SessionRegistry", "SessionState", "TurnSlot", "json_bytes", "segment_bytes"]

SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def json_bytes(value: Any) -> int:
    """The size of `value` as JSON (0 for None): what a session keeps of an
    object it stores as it came (tools, template kwargs, metadata)."""
    return 0 if value is None else len(orjson.dumps(value))


def segment_bytes(segment: Segment) -> int:
    """The bytes of text a segment keeps: its conversation's, its tools' and
    its template kwargs' (docs/reliability.md#what-a-session-keeps)."""
    return (
        segment.conversation.text_bytes
        + json_bytes(segment.tools)
        + json_bytes(segment.template_kwargs)
    )


class SessionState(enum.Enum):
    # Takes turns (at most one in flight).
    OPEN = "open"
    # A DELETE is under way: new turns get 404 session_closing, the in-flight
    # turn (if any) is being cancelled; the session is forgotten next, whatever
    # the DELETE's client does (SessionStore.close). The journal holds it as
    # expired meanwhile, so a crash brings it back expired, not open.
    CLOSING = "closing"
    # Closed by the server itself (idle TTL, shutdown): no more turns, but the
    # document stays readable until a DELETE collects it.
    EXPIRED = "expired"
    # Collected by a DELETE: no more turns, unpinned, not listed and not
    # counted against --max-sessions; its document stays readable (a repeated
    # DELETE gets it again) for --keep-collected-s, then it is forgotten.
    COLLECTED = "closed"


@dataclass(slots=True)
class TurnSlot:
    """The in-flight turn of a session. The turn's handler runs inside
    `cancel_scope`; `done` is set once it has released the slot."""

    started_at: float
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)


@dataclass(slots=True)
class Session:
    id: str
    metadata: dict[str, Any]
    created_at: float
    last_active_at: float
    ttl_s: float | None = None
    state: SessionState = SessionState.OPEN
    # The current segment (segments.py): its trajectory, conversation, tools
    # and template kwargs. Turns read and extend only these.
    trajectory: Trajectory = field(default_factory=Trajectory)
    # Stored conversation: the last request's messages + the assistant answer
    # we returned. Turn k's messages end at trajectory.turns[k].messages_end.
    # Compact records (see conversation.py); `messages` is the dict view.
    conversation: Conversation = field(default_factory=Conversation)
    # Tools of the first rendered prompt; a request with other tools diverges.
    tools: list[Any] | None = None
    # Chat-template kwargs of the last turn (server defaults merged under the
    # request's own): what the inspector's re-render must use.
    template_kwargs: dict[str, Any] | None = None
    # Where the current segment branched off (None: the session's first).
    branch: Branch | None = None
    # The segments before the current one, oldest first; sealed, never changed.
    earlier: list[Segment] = field(default_factory=list)
    # Every commit that replaced turns (a retry, a bounded rollback), in order.
    rollbacks: list[Rollback] = field(default_factory=list)
    # Base URL of the worker this session is pinned to (None before turn 1).
    worker: str | None = None
    # SGLang `priority` of its turns (None: the server's default, if any).
    priority: int | None = None
    # The trainer's sampling, pinned for every turn whatever the agent sends
    # (`turn.sampling`: validated on creation; None: the agent's own).
    sampling: dict[str, Any] | None = None
    model: str | None = None
    closed_at: float | None = None
    # Invariant: not None exactly while a turn is in flight.
    slot: TurnSlot | None = None
    # The worker the session was last pinned to, kept when its pin is
    # released (expiry, collection): a closed session's rescore "pinned"
    # goes to the worker that sampled it.
    last_worker: str | None = None
    # The bytes of text its sealed segments keep (`segment_bytes`): added
    # when one is sealed, taken back when it is reopened.
    sealed_bytes: int = 0
    # Its metadata's JSON size, measured once (metadata never changes).
    _metadata_bytes: int | None = field(default=None, init=False, repr=False)
    # Set when the session stops taking turns (`stopped`); made on demand.
    _stopped: trio.Event | None = field(default=None, init=False, repr=False)

    @property
    def messages(self) -> list[Message]:
        """The stored conversation as fresh dicts: O(messages), so for export,
        the journal and the inspector; turns use `conversation` directly."""
        return self.conversation.messages()

    @messages.setter
    def messages(self, messages: list[Message]) -> None:
        self.conversation = Conversation(messages)

    @property
    def current(self) -> Segment:
        """The current segment as a `Segment` (a view of this session's fields)."""
        return Segment(
            self.trajectory, self.conversation, self.tools, self.template_kwargs, self.branch
        )

    def segments(self) -> list[Segment]:
        """Every segment, oldest first, the current one last."""
        return [*self.earlier, self.current]

    @property
    def metadata_bytes(self) -> int:
        """Its metadata's JSON size (measured once: metadata never changes)."""
        if self._metadata_bytes is None:
            self._metadata_bytes = json_bytes(self.metadata)
        return self._metadata_bytes

    def stored_bytes(self) -> int:
        """The bytes of text the session keeps: its metadata, and every
        segment's `segment_bytes` (docs/reliability.md#what-a-session-keeps).
        O(the current segment's tools and kwargs), never O(history)."""
        return self.metadata_bytes + self.sealed_bytes + segment_bytes(self.current)

    def start_segment(self, branch: Branch) -> None:
        """Seal the current segment and make an empty one current (its first
        turn is committed next, in the same synchronous step)."""
        self.sealed_bytes += segment_bytes(self.current)
        self.earlier.append(self.current)
        self.trajectory = Trajectory()
        self.conversation = Conversation()
        self.tools = None
        self.template_kwargs = None
        self.branch = branch

    def reopen_segment(self, segment: Segment) -> None:
        """Undo `start_segment`: `segment` (the last sealed) is current again."""
        if not self.earlier or self.earlier[-1] is not segment:
            raise ValueError("only the last sealed segment can be reopened")
        self.earlier.pop()
        self.sealed_bytes -= segment_bytes(segment)
        self.trajectory = segment.trajectory
        self.conversation = segment.conversation
        self.tools = segment.tools
        self.template_kwargs = segment.template_kwargs
        self.branch = segment.branch

    def refusal(self) -> ClientError | None:
        """Why the session takes no turns (None: it is open)."""
        if self.state is SessionState.CLOSING:
            return SessionClosing(f"session {self.id} is being closed")
        if self.state is not SessionState.OPEN:
            return SessionNotFound(f"session {self.id} is {self.state.value}; it takes no turns")
        return None

    def stopped(self) -> trio.Event:
        """An event set once the session stops taking turns (closing,
        expired, collected): what a turn waiting to claim it (at the pause
        gate) also wakes on. Already set for a session that takes none."""
        if self._stopped is None:
            self._stopped = trio.Event()
            if self.state is not SessionState.OPEN:
                self._stopped.set()
        return self._stopped

    def claim(self, now: float) -> TurnSlot:
        """Take the turn slot, or raise why not (closing beats busy)."""
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        if self.slot is not None:
            raise SessionBusy(f"session {self.id} already has a turn in flight")
        self.slot = TurnSlot(started_at=now)
        self.last_active_at = now
        return self.slot

    def release(self, slot: TurnSlot, now: float) -> None:
        if self.slot is slot:
            self.slot = None
            self.last_active_at = now
        slot.done.set()

    def begin_close(self, now: float) -> TurnSlot | None:
        """Enter CLOSING and cancel the in-flight turn; return it to wait on."""
        return self._stop(SessionState.CLOSING, now)

    def expire(self, now: float) -> None:
        """Enter EXPIRED and cancel the in-flight turn."""
        self._stop(SessionState.EXPIRED, now)

    def _stop(self, state: SessionState, now: float) -> TurnSlot | None:
        self.state = state
        self.closed_at = now
        stopped, self._stopped = self._stopped, None  # a reopened session makes another
        if stopped is not None:
            stopped.set()
        slot = self.slot
        if slot is not None:
            slot.cancel_scope.cancel()
        return slot

    def summary(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "state": self.state.value,
            # Over every segment; the turns replaced in place are gone.
            "num_turns": sum(len(s.trajectory.turns) for s in self.earlier)
            + len(self.trajectory.turns),
            "num_tokens": sum(len(s.trajectory) for s in self.earlier) + len(self.trajectory),
            "num_segments": len(self.earlier) + 1,
            "num_rollbacks": len(self.rollbacks),
            "worker": self.worker,
            "priority": self.priority,
            "sampling": self.sampling,
            "created_at": self.created_at,
            "last_active_at": self.last_active_at,
            "metadata": self.metadata,
        }


class SessionRegistry:
    """All sessions of one server, in creation order.

    Collected sessions are held too (`get` finds them) but apart: `len`,
    iteration, paging without a state and the --max-sessions cap see only the
    others, the sessions a trainer still has to collect.
    """

    def __init__(
        self, clock: Callable[[], float] = time.time, max_sessions: int | None = None
    ) -> None:
        self.clock = clock
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}
        # Creation order for paging: a cursor is found in O(log n), so listing
        # every session page by page is not quadratic. Invariant: the same
        # sessions as `_sessions`, each under the number `_order` gives it.
        self._by_order: SortedDict = SortedDict()
        self._order: dict[str, int] = {}
        self._next = itertools.count()
        # The collected ones among `_sessions`, in the order they were collected.
        self._collected: dict[str, Session] = {}

    def __len__(self) -> int:
        """Sessions held, collected ones aside."""
        return len(self._sessions) - len(self._collected)

    def __iter__(self) -> Iterator[Session]:
        """Sessions held, collected ones aside (a copy: safe to change them meanwhile)."""
        collected = self._collected
        return iter([s for s in self._sessions.values() if s.id not in collected])

    def collected(self) -> list[Session]:
        """The collected sessions still held, oldest collection first."""
        return list(self._collected.values())

    def collect(self, session: Session) -> None:
        """Mark a held session collected (its close is done)."""
        if self._sessions.get(session.id) is not session:
            raise SessionNotFound(f"session {session.id} does not exist")
        session.state = SessionState.COLLECTED
        self._collected[session.id] = session

    def uncollect(self, session: Session, state: SessionState, closed_at: float | None) -> None:
        """Undo `collect` (its journal record did not become durable)."""
        self._collected.pop(session.id, None)
        session.state, session.closed_at = state, closed_at

    def create(
        self,
        session_id: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        ttl_s: float | None = None,
        priority: int | None = None,
        sampling: dict[str, Any] | None = None,
        replacing: Session | None = None,
    ) -> Session:
        """A new session. `replacing`, a collected session holding the same
        id, is dropped for it once every check has passed."""
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not SESSION_ID.fullmatch(session_id) or session_id in (".", ".."):
            # In full (`$` would let a final newline through), and usable as
            # one path segment of a URL (`.` and `..` are not).
            raise InvalidRequest(
                "session_id must match [A-Za-z0-9._:-]{1,128} and not be '.' or '..'",
                param="session_id",
            )
        held = self._sessions.get(session_id)
        if held is not None and not (held is replacing and held.state is SessionState.COLLECTED):
            raise SessionExists(f"session {session_id} already exists")
        if self.max_sessions is not None and len(self) >= self.max_sessions:
            raise TooManySessions(
                f"the server holds {len(self)} sessions (--max-sessions); "
                "collect finished ones first"
            )
        if held is not None:
            self.remove(held)
        now = self.clock()
        session = Session(
            id=session_id,
            metadata=dict(metadata or {}),
            created_at=now,
            last_active_at=now,
            ttl_s=ttl_s,
            priority=priority,
            sampling=sampling,
        )
        self._add(session)
        return session

    def restore(self, session: Session) -> None:
        """Put back a session rebuilt from the journal (no caps: it existed)."""
        self._add(session)
        if session.state is SessionState.COLLECTED:
            self._collected[session.id] = session

    def _add(self, session: Session) -> None:
        order = self._order.pop(session.id, None)
        if order is not None:
            del self._by_order[order]
        self._sessions[session.id] = session
        self._order[session.id] = order = next(self._next)
        self._by_order[order] = session

    def get(self, session_id: str) -> Session:
        """A held session, collected ones included."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id} does not exist")
        return session

    def find(self, session_id: str | None) -> Session | None:
        return None if session_id is None else self._sessions.get(session_id)

    def remove(self, session: Session) -> None:
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
            del self._by_order[self._order.pop(session.id)]
            self._collected.pop(session.id, None)

    def page(
        self, *, state: SessionState | None, limit: int, after: str | None
    ) -> tuple[list[Session], bool]:
        """Sessions in creation order after the id `after`; (page, has_more).

        Collected sessions are listed only when `state` asks for them.
        O(log n + what the page covers): sessions of another state on the
        way are skipped, the rest of the registry is not touched."""
        start = None
        if after is not None:
            start = self._order.get(after)
            if start is None:
                raise InvalidRequest(f"unknown cursor {after!r}", param="after")
        out: list[Session] = []
        for order in self._by_order.irange(minimum=start, inclusive=(False, True)):
            session: Session = self._by_order[order]
            if session.state is not state and (
                state is not None or session.state is SessionState.COLLECTED
            ):
                continue
            if len(out) == limit:
                return out, True
            out.append(session)
        return out, False
