"""The emulator's model of SGLang 0.5.23's session controller (``/open_session``
sessions, ``session_params`` on ``/generate``).

Mirrors ``sglang/srt/session/session_controller.py`` (``Session.create_req``,
``finish_req``, ``abort_req``, ``SessionController.open/close/maybe_reap``)
and the KV side of ``session/streaming_session.py``: a streaming session keeps
its last finished turn's context (prompt ids + sampled ids) and, while that
turn's KV record is in its slot, those tokens' KV outside the evictable prefix
cache. Every message is SGLang's, verbatim; docs/emulator.md has the table.

Mutation is synchronous (the emulator is one trio task per request; nothing
here awaits), the clock is passed in (the emulator's, so tests move it).
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SessionError",
    "SessionTable",
    "SessionTurn",
    "Turn",
    "strip_bos",
]


class SessionError(Exception):
    """A request the scheduler finishes with ``FINISH_ABORT(message)`` (status 400)."""


class TurnState(enum.Enum):
    RUNNING = "running"  # created, not finished: the session is in flight on it
    FINISHED = "finished"  # finish_req ran: the session's rollback point
    ABORTED = "aborted"  # abort_req ran: the session keeps its previous rollback point


@dataclass
class Turn:
    """One request of a session (SGLang's ``Req`` as the session sees it)."""

    rid: str
    context: list[int]  # origin_input_ids: history + new input ids
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    state: TurnState = TurnState.RUNNING


@dataclass
class SessionTurn:
    """What `SessionTable.create` gives the emulator for one accepted request."""

    session_id: str
    turn: Turn
    held_prefix: int | None  # tokens served from the session slot; None: look up the prefix cache
    # The turn takes a new slot (first turn, or the first after an abort): its
    # prompt is published into the prefix cache for other requests to share.
    publish: bool
    streaming: bool  # False: an ordinary request for the cache (looked up and filled)


@dataclass
class _Session:
    session_id: str
    capacity_of_str_len: int  # stored, never enforced (as in SGLang 0.5.23)
    streaming: bool
    timeout: float | None
    last_active: float
    nodes: dict[str, Turn] = field(default_factory=dict)  # req_nodes (streaming: at most one)
    inflight: Turn | None = None  # streaming: the one request running on the session
    close_on_finish: bool = False
    # Tokens whose KV the session's slot holds (0: no slot). The slot is taken
    # by the first turn, kept by every finished turn, dropped by an abort.
    held_tokens: int = 0


def strip_bos(ids: list[int], bos_token_id: int | None) -> list[int]:
    """``Session._strip_bos_token``: an appended turn loses one leading BOS."""
    if bos_token_id is not None and ids and ids[0] == bos_token_id:
        return ids[1:]
    return ids


class SessionTable:
    """SGLang's ``SessionController`` for one emulator (lost with it on restart)."""

    def __init__(self, bos_token_id: int | None) -> None:
        self.bos_token_id = bos_token_id
        self._sessions: dict[str, _Session] = {}
        self.opened = 0
        self.closed = 0
        self.timed_out = 0

    # -- lifecycle ---------------------------------------------------------

    def open(
        self,
        session_id: str | None,
        capacity_of_str_len: int,
        streaming: bool,
        timeout: float | None,
        now: float,
    ) -> str | None:
        """The new session's id, or None when the id is taken (SGLang: success=False)."""
        sid = session_id if session_id is not None else uuid.uuid4().hex
        if sid in self._sessions:
            return None
        self._sessions[sid] = _Session(sid, capacity_of_str_len, streaming, timeout, now)
        self.opened += 1
        return sid

    def close(self, session_id: str) -> None:
        """Close now, or when its in-flight request finishes; an unknown id is a no-op."""
        session = self._sessions.get(session_id)
        if session is not None:
            self._close(session)

    def _close(self, session: _Session) -> None:
        if session.inflight is not None or any(
            t.state is TurnState.RUNNING for t in session.nodes.values()
        ):
            session.close_on_finish = True
            return
        del self._sessions[session.session_id]
        self.closed += 1

    def reap(self, now: float) -> list[str]:
        """``maybe_reap``: finish deferred closes, then close timed-out sessions.

        SGLang's timeout counts from the last request *created* on the session
        (``last_active_time`` is set in ``create_req`` only), not from its finish.
        Returns the ids it closed.
        """
        before = set(self._sessions)
        for session in list(self._sessions.values()):
            if session.close_on_finish and session.inflight is None:
                session.close_on_finish = False
                self._close(session)
        for session in list(self._sessions.values()):
            if session.close_on_finish:
                continue
            if session.timeout is not None and now - session.last_active > session.timeout:
                self.timed_out += 1
                self._close(session)
        return [sid for sid in before if sid not in self._sessions]

    # -- requests ----------------------------------------------------------

    def create(
        self,
        session_params: dict[str, Any],
        rid: str,
        input_ids: Sequence[int],
        max_new_tokens: int,
        now: float,
    ) -> SessionTurn:
        """``Scheduler._handle_generate_request`` + ``Session.create_req``.

        Raises `SessionError` with SGLang's message for every request the
        scheduler aborts before running it.
        """
        sid = session_params.get("id")
        session = self._sessions.get(sid) if isinstance(sid, str) else None
        if session is None:
            raise SessionError(f"Invalid request: session id {sid} does not exist")
        if session.close_on_finish:
            raise SessionError(f"Invalid request: close was requested for session {sid}")
        rid_param = session_params.get("rid")
        offset = session_params.get("offset") or 0
        replace = bool(session_params.get("replace"))
        drop = bool(session_params.get("drop_previous_output"))
        last: Turn | None = None
        if session.streaming:
            if session.inflight is not None:
                raise SessionError("Streaming session already has an active request.")
            if replace:
                raise SessionError("Streaming sessions do not support replace.")
            if drop:
                raise SessionError("Streaming sessions do not support drop_previous_output.")
            if offset:
                raise SessionError("Streaming sessions do not support offset.")
            if session.nodes:
                [last] = session.nodes.values()
        elif replace:
            if rid_param is None:
                session.nodes.clear()
            elif rid_param not in session.nodes:
                raise SessionError("Invalid request session id")
            else:
                last = session.nodes[rid_param]
        elif rid_param is not None:
            if rid_param not in session.nodes:
                raise SessionError("Invalid request session id")
            last = session.nodes[rid_param]
            if last.state is TurnState.RUNNING:
                raise SessionError(
                    "Session request is appending to a request that hasn't finished."
                )

        new_ids = list(input_ids)
        if last is not None:
            new_ids = strip_bos(new_ids, self.bos_token_id)
            tail = last.output[: last.max_new_tokens]
            base = list(last.context) if drop else [*last.context, *tail]
            context = [*base[:offset], *new_ids] if offset else [*base, *new_ids]
        else:
            context = new_ids
        if not context:
            raise SessionError(
                "A session request must contain input tokens after restoring history."
            )
        turn = Turn(rid, context, max_new_tokens)
        session.last_active = now
        held: int | None = None
        publish = session.streaming and not session.held_tokens
        if session.streaming:
            session.inflight = turn
            if session.held_tokens:
                # StreamingSession.try_match_prefix: the slot's committed KV, less the
                # last position whose logits the new turn must compute.
                held = min(session.held_tokens, len(context) - 1)
        else:
            session.nodes[rid] = turn
        return SessionTurn(session.session_id, turn, held, publish, session.streaming)

    def finish(self, st: SessionTurn, output: Sequence[int]) -> None:
        """``finish_req`` (via ``try_cache_finished_req``): the turn is the rollback point."""
        st.turn.output = list(output)
        st.turn.state = TurnState.FINISHED
        session = self._sessions.get(st.session_id)
        if session is None or not session.streaming:
            return
        session.inflight = None
        session.nodes = {st.turn.rid: st.turn}
        # The last sampled token is never forwarded, so its KV never exists.
        session.held_tokens = len(st.turn.context) + len(output) - 1
        if session.close_on_finish:
            session.close_on_finish = False
            self._close(session)

    def abort(self, st: SessionTurn) -> None:
        """``abort_req``: the slot's record goes back, the rollback point stays."""
        st.turn.state = TurnState.ABORTED
        session = self._sessions.get(st.session_id)
        if session is None:
            return
        if session.streaming:
            session.inflight = None
            session.held_tokens = 0
        else:
            session.nodes.pop(st.turn.rid, None)
        if session.close_on_finish:
            session.close_on_finish = False
            self._close(session)

    # -- observability -----------------------------------------------------

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def held_tokens(self) -> int:
        """KV tokens held by session slots (outside the evictable cache)."""
        return sum(s.held_tokens for s in self._sessions.values())

    def context(self, session_id: str) -> list[int] | None:
        """The ids the session's next append continues: last finished context + output."""
        session = self._sessions.get(session_id)
        if session is None or not session.nodes:
            return None
        [last, *_] = reversed(session.nodes.values())
        return [*last.context, *last.output[: last.max_new_tokens]]

    def stats(self) -> dict[str, Any]:
        return {
            "open": len(self._sessions),
            "opened": self.opened,
            "closed": self.closed,
            "timed_out": self.timed_out,
            "held_tokens": self.held_tokens,
            "sessions": {
                sid: {
                    "streaming": s.streaming,
                    "inflight": s.inflight is not None,
                    "close_on_finish": s.close_on_finish,
                    "held_tokens": s.held_tokens,
                }
                for sid, s in self._sessions.items()
            },
        }
