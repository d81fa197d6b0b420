"""Session records of the journal: encoding sessions' events, and replay.

Owns what a record means: the meta and blobs of each event of a journaled
session (built on the event loop from the state the change left, O(new
tokens)), and `Replay`, which applies records in order to rebuild sessions
and checks every one against the invariants `Trajectory.commit` trusts. How
records are framed and stored in segment files is `format`.

Records (meta ``"t"``), ``id`` being the session id (``begin``, the first
record of every segment, belongs to `format`):

- ``create`` ``md`` metadata, ``ca`` created_at, ``ttl`` ttl_s, ``pri`` priority
  and ``smp`` the pinned sampling (each only when set).
- ``turn``   ``turn`` the `Turn` fields (``index`` is the number of turns
  kept, i.e. the rollback point), ``mf`` messages kept, ``msgs`` messages
  appended after them, ``tools`` (only when ``index == 0``), ``kw`` the
  chat-template kwargs the prompt was rendered with, ``model``, ``worker``,
  ``w`` experts width or null, ``ex`` whether experts were given; ``seg``
  the new segment's branch when the turn starts one (the current segment is
  sealed first), ``rb`` the rollback when it replaces turns; blobs: prompt
  ids (mask 0), sampled ids, sampled logprobs[, experts].
- ``expire`` ``cl`` closed_at, ``worker``; replay restores it as ``expired``.
  Also written when a DELETE begins collecting an open session (``why``
  ``"close"``, ``worker`` null): a close in progress at a crash comes back
  expired (closed, readable, collectable), never open.
- ``collect`` ``cl`` closed_at: a DELETE collected the session; replay
  restores it ``closed`` (readable, unpinned) until ``close`` forgets it.
- ``close``  the session was forgotten (its keep window over, or dropped
  before it was collected): replay forgets it. (Journals written before
  ``collect`` existed used it for collections too.)
- ``snapshot`` a session's full state (create fields + ``st`` state, ``open``,
  ``expired`` (a closing session is snapshotted expired and unpinned) or
  ``closed``, ``cl``, ``model``, ``worker``, ``rbs`` its rollbacks, ``segs``
  its segments, oldest first, each ``tools``, ``kw``, ``msgs``, ``turns``,
  ``w``, ``br``); blobs: per segment all ids, all logprobs, all experts. A snapshot
  replaces whatever earlier records said of its session: compaction writes
  one per session into a new segment, and a journal recovering from a failed
  write appends one per session whose records were lost.

Bytes a later record supersedes — a collected-and-forgotten session's, the
turns a rollback drops, everything before a snapshot — are dead (a new
segment supersedes nothing: its earlier segments stay): compaction
reclaims them (`TurnBytes` counts the turns').
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import fields
from typing import Any

import numpy as np

from ..segments import Branch, Rollback, Segment
from ..session import Session, SessionState
from ..trajectory import Trajectory, Turn
from .format import JournalError, Parts, encode
from .reader import Damage, Record

__all__ = ["Replay", "TurnBytes", "create_meta", "snapshot_parts", "turn_parts"]

# The journal's one logger, whichever of its modules speaks.
logger = logging.getLogger("rollout_session.journal")

_TURN_FIELDS = tuple(f.name for f in fields(Turn))


# --- encoding (runs on the event loop: O(new tokens), copies only the delta) ---


def create_meta(session: Session) -> dict[str, Any]:
    return {
        "t": "create",
        "id": session.id,
        "md": session.metadata,
        "ca": session.created_at,
        "ttl": session.ttl_s,
        **({} if session.priority is None else {"pri": session.priority}),
        **({} if session.sampling is None else {"smp": session.sampling}),
    }


def _turn_dict(turn: Turn) -> dict[str, Any]:
    fields = {name: getattr(turn, name) for name in _TURN_FIELDS}
    # Named tuples as plain lists (what `Turn.of` reads back).
    fields["weight_versions"] = [list(s) for s in turn.weight_versions]
    fields["continuations"] = [list(c) for c in turn.continuations]
    return fields


def _le(array: Any, dtype: str) -> bytes:
    return np.asarray(array).astype(dtype, copy=False).tobytes()


def turn_parts(
    session: Session, experts: bytes | None, *, new_segment: bool, rolled_back: bool
) -> Parts:
    """The session's last committed turn as a delta, read back from the state
    it left (so replay reproduces exactly what is in memory): whether it
    started a segment (`session.branch`) or replaced turns (the last of
    `session.rollbacks`) is the commit's to say."""
    trajectory = session.trajectory
    turn = trajectory.turns[-1]
    keep = turn.index
    kept = trajectory.turns[keep - 1].messages_end if keep else 0
    tokens = trajectory.tokens
    meta: dict[str, Any] = {
        "t": "turn",
        "id": session.id,
        "turn": _turn_dict(turn),
        "mf": kept,
        "msgs": session.conversation.messages(kept),
        "model": session.model,
        "worker": session.worker,
        "kw": session.template_kwargs,
        "w": trajectory.experts_width if experts is not None else None,
        "ex": experts is not None,
    }
    if keep == 0:
        meta["tools"] = session.tools
    if new_segment and session.branch is not None:
        meta["seg"] = session.branch.as_dict()
    if rolled_back:
        meta["rb"] = session.rollbacks[-1].as_dict()
    # Views of the turn's own chunk: O(turn), not O(history).
    blobs = [
        _le(tokens.ids_between(turn.prompt_start, turn.completion_start), "<i4"),
        _le(tokens.ids_between(turn.completion_start, turn.completion_end), "<i4"),
        _le(tokens.sampled_logprobs(turn.completion_start, turn.completion_end), "<f4"),
    ]
    if experts is not None:
        blobs.append(bytes(experts))  # `bytes` of a bytes object is that object
    return encode(meta, blobs)


def _segment_meta(segment: Segment) -> dict[str, Any]:
    trajectory = segment.trajectory
    return {
        "tools": segment.tools,
        "kw": segment.template_kwargs,
        "msgs": segment.conversation.messages(),
        "turns": [_turn_dict(t) for t in trajectory.turns],
        "w": trajectory.experts_width,
        "br": segment.branch.as_dict() if segment.branch is not None else None,
    }


def snapshot_parts(session: Session) -> Parts:
    meta = create_meta(session)
    # A closing session is expired and unpinned on disk, as its `expire`
    # record says (see above); every other state is stored as it is.
    closing = session.state is SessionState.CLOSING
    segments = session.segments()
    meta.update(
        t="snapshot",
        st=SessionState.EXPIRED.value if closing else session.state.value,
        cl=session.closed_at,
        model=session.model,
        worker=None if closing else session.worker,
        lw=session.worker or session.last_worker,
        rbs=[r.as_dict() for r in session.rollbacks],
        segs=[_segment_meta(s) for s in segments],
    )
    blobs = []
    for segment in segments:
        trajectory = segment.trajectory
        blobs += [
            _le(trajectory.tokens.ids, "<i4"),
            _le(trajectory.tokens.logprobs, "<f4"),
            bytes(trajectory.experts),
        ]
    return encode(meta, blobs)


# --- byte accounting ---


class TurnBytes:
    """The framed sizes of a session's turn records still in effect, so that
    a rollback's superseded turns count as dead bytes. Turns before `base`
    came in one record (a create has none, a snapshot all it held)."""

    __slots__ = ("base", "sizes")

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.sizes = array("q")  # untracked by the GC, 8 bytes a turn

    def turn(self, index: int, size: int) -> int:
        """A turn record keeping `index` turns, of `size` bytes: return the
        bytes of the turn records it supersedes."""
        keep = max(0, index - self.base)
        dead = sum(self.sizes[keep:])
        del self.sizes[keep:]
        # Turns of the base record it drops stay counted: that record is live.
        self.base = min(self.base, index)
        self.sizes.append(size)
        return dead


# --- replay ---


class Replay:
    """Applies records in order to rebuild sessions, and counts bytes per
    session so the journal knows how much compaction would reclaim."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.sessions: dict[str, Session] = {}
        self.live_bytes: dict[str, int] = {}
        self.turn_bytes: dict[str, TurnBytes] = {}
        self.dead_bytes = 0
        self.records = 0
        # Sessions whose record could not be applied or is damaged: dropped,
        # later records ignored (until a snapshot or a create starts it afresh).
        self._poisoned: set[str] = set()

    def apply(self, record: Record) -> None:
        meta = record.meta
        kind, sid = meta["t"], meta.get("id")
        if not isinstance(sid, str):
            raise JournalError(f"{kind} record at offset {record.offset} has no session id")
        self.records += 1
        if kind == "close":
            self._forget(sid)
            self.dead_bytes += record.size
            return
        if kind == "snapshot" or (kind == "create" and sid in self._poisoned):
            # Starts the session afresh: what came before is superseded.
            self._forget(sid)
        live = self.live_bytes.get(sid, 0) + record.size
        if kind == "turn":
            turn = meta.get("turn")
            index = turn.get("index") if isinstance(turn, dict) else None
            if "seg" in meta:  # the earlier segments' records stay live
                self.turn_bytes[sid] = TurnBytes()
            if isinstance(index, int):
                dead = self.turn_bytes.setdefault(sid, TurnBytes()).turn(index, record.size)
                self.dead_bytes += dead
                live -= dead
        self.live_bytes[sid] = live
        if sid in self._poisoned:
            return
        try:
            self._apply(kind, sid, meta, record.blobs)
        except (KeyError, TypeError, ValueError, IndexError):
            # A record that passed its crc but does not apply is a bug, not a
            # torn write: lose this session (loudly), keep all the others.
            logger.exception("journal: dropping session %s (%s at %d)", sid, kind, record.offset)
            self.sessions.pop(sid, None)
            self._poisoned.add(sid)

    def damaged(self, damage: Damage) -> None:
        """Bytes that held records are unreadable: the sessions known to have
        had a record there are dropped (their later records would build on
        a gap), every other session replays on."""
        for sid in damage.session_ids:
            if self.sessions.pop(sid, None) is not None:
                logger.error(
                    "journal: dropping session %s: one of its records is damaged (offset %d)",
                    sid,
                    damage.start,
                )
            self._poisoned.add(sid)

    def _forget(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self._poisoned.discard(sid)
        self.turn_bytes.pop(sid, None)
        self.dead_bytes += self.live_bytes.pop(sid, 0)

    def _apply(self, kind: str, sid: str, meta: dict[str, Any], blobs: list[memoryview]) -> None:
        if kind in ("create", "snapshot"):
            if sid in self.sessions:
                raise ValueError("session created twice")
            self.sessions[sid] = session = self._session(meta, blobs)
            self.turn_bytes[sid] = TurnBytes(len(session.trajectory.turns))
        elif kind == "turn":
            _apply_turn(self.sessions[sid], meta, blobs)
        elif kind == "expire":
            session = self.sessions[sid]
            session.state = SessionState.EXPIRED
            session.closed_at = meta["cl"]
            session.worker = meta["worker"]
            session.last_worker = meta.get("lw") or session.last_worker
        elif kind == "collect":
            session = self.sessions[sid]
            session.state = SessionState.COLLECTED
            session.closed_at = meta["cl"]
            session.last_worker = meta.get("lw") or session.worker or session.last_worker
            session.worker = None
        else:
            raise ValueError(f"unknown record type {kind!r}")

    def finish(self) -> list[Session]:
        for sid, session in list(self.sessions.items()):
            problem = next(
                (p for s in session.segments() if (p := s.trajectory.check()) is not None), None
            )
            if problem is not None:
                logger.error("journal: dropping session %s: %s", sid, problem)
                del self.sessions[sid]
        for sid in list(self.live_bytes):
            if sid not in self.sessions:  # dropped as unreadable: as good as forgotten
                self._forget(sid)
        return list(self.sessions.values())

    def _session(self, meta: dict[str, Any], blobs: list[memoryview]) -> Session:
        md = meta["md"]
        if not isinstance(md, dict):
            raise TypeError("metadata is not an object")
        session = Session(
            id=meta["id"],
            metadata=md,
            created_at=meta["ca"],
            # Downtime is not idleness: a restored session gets a full TTL.
            last_active_at=self.now,
            ttl_s=meta["ttl"],
            priority=meta.get("pri"),
            sampling=meta.get("smp"),
        )
        if meta["t"] == "snapshot":
            _apply_snapshot(session, meta, blobs)
        return session


def _apply_turn(session: Session, meta: dict[str, Any], blobs: list[memoryview]) -> None:
    turn = Turn.of(meta["turn"])
    keep = turn.index
    if meta.get("seg") is not None:
        if keep != 0 or not session.trajectory.turns:
            raise ValueError("a new segment must start with turn 0 after a turn")
        session.start_segment(Branch.of(meta["seg"]))
    if meta.get("rb") is not None:
        session.rollbacks.append(Rollback.of(meta["rb"]))
    trajectory = session.trajectory
    prompt = np.frombuffer(blobs[0], "<i4")
    sampled = np.frombuffer(blobs[1], "<i4")
    logprobs = np.frombuffer(blobs[2], "<f4")
    # Check what commit() trusts, so a bad record cannot break invariants.
    if keep > len(trajectory.turns) or turn.prompt_start != trajectory.length_after(keep):
        raise ValueError(f"turn {keep} does not start where the kept turns end")
    ends = (turn.completion_start, turn.completion_end)
    if ends != (turn.prompt_start + len(prompt), turn.prompt_start + len(prompt) + len(sampled)):
        raise ValueError("turn span does not match its token counts")
    kept = trajectory.turns[keep - 1].messages_end if keep else 0
    if meta["mf"] != kept or kept > len(session.conversation):
        raise ValueError(f"turn keeps {meta['mf']} messages, expected {kept}")
    experts = bytes(blobs[3]) if meta["ex"] else None
    width = meta["w"]
    if experts is not None and (
        not isinstance(width, int)
        or width <= 0
        or len(experts) % (4 * width)
        or trajectory.experts_width not in (None, width)
    ):
        raise ValueError(f"routed experts of width {width!r} do not fit")
    trajectory.commit(
        keep_turns=keep,
        prompt_ids=prompt,
        sampled_ids=sampled,
        sampled_logprobs=logprobs,
        turn=turn,
        experts=experts,
        experts_width=width,
    )
    session.conversation = session.conversation.spliced(kept, meta["msgs"])
    if turn.messages_end != len(session.conversation):
        raise ValueError("turn's messages_end does not match the messages")
    if keep == 0:
        session.tools = meta["tools"]
    session.template_kwargs = meta.get("kw")
    session.model = meta["model"]
    session.worker = meta["worker"]


def _apply_snapshot(session: Session, meta: dict[str, Any], blobs: list[memoryview]) -> None:
    # Journals written before segments: the session's one segment at the top.
    raw_segments = meta.get("segs") or [{**meta, "br": None}]
    if len(blobs) != 3 * len(raw_segments):
        raise ValueError("snapshot segments do not match its blobs")
    for i, raw in enumerate(raw_segments):
        if i:
            session.start_segment(Branch.of(raw["br"]))
        elif raw["br"] is not None:
            raise ValueError("a session's first segment has no branch")
        _restore_trajectory(session.trajectory, raw, blobs[3 * i : 3 * i + 3])
        session.messages = list(raw["msgs"])
        session.tools = raw["tools"]
        session.template_kwargs = raw.get("kw")
    session.rollbacks = [Rollback.of(r) for r in meta.get("rbs", ())]
    session.model = meta["model"]
    session.worker = meta["worker"]
    session.last_worker = meta.get("lw")
    session.state = SessionState(meta["st"])
    session.closed_at = meta["cl"]


def _restore_trajectory(
    trajectory: Trajectory, meta: dict[str, Any], blobs: list[memoryview]
) -> None:
    ids = np.frombuffer(blobs[0], "<i4")
    logprobs = np.frombuffer(blobs[1], "<f4")
    turns = [Turn.of(t) for t in meta["turns"]]
    width = meta["w"]
    if len(ids) != len(logprobs) or (turns and turns[-1].completion_end != len(ids)):
        raise ValueError("snapshot arrays do not match its turns")
    if width is not None and not turns:
        raise ValueError("snapshot has routed experts but no turns")
    for i, turn in enumerate(turns):
        last = i == len(turns) - 1
        # Turns go through the one commit path; the experts blob (whole) rides
        # on the last one, which restores it and its width exactly.
        trajectory.commit(
            keep_turns=i,
            prompt_ids=ids[turn.prompt_start : turn.completion_start],
            sampled_ids=ids[turn.completion_start : turn.completion_end],
            sampled_logprobs=logprobs[turn.completion_start : turn.completion_end],
            turn=turn,
            experts=bytes(blobs[2]) if last and width is not None else None,
            experts_width=width if last else None,
        )
