"""What a turn commits: the plan `plan_turn` makes, and applying it.

`commit_turn` is the one place a turn changes a session in memory: a new
segment or a rollback (if the plan says so), the prompt delta, the sampled
ids, the new messages; `CommitUndo` is the one way to take it back. It is
plain synchronous code; the session store calls it between
checking that the journal can record the turn and recording it
(`SessionStore.commit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from ..errors import InvariantViolated, SessionClosing
from ..prompt.messages import Message
from ..tokens import IdArray, LogprobArray, VersionSpan
from .conversation import Record
from .segments import Branch, Rollback, Segment
from .session import Session, SessionState, TurnSlot
from .trajectory import Checkpoint, Continuation, Turn

__all__ = ["CommitUndo", "Sampled", "TurnPlan", "commit_turn"]


@dataclass(slots=True)
class TurnPlan:
    """What a turn will commit if the worker answers well."""

    keep_turns: int  # turns of the current segment kept; fewer than it has = rollback
    messages: list[Message]  # the request's messages (history for the next turn)
    tools: list[Any] | None
    kwargs: dict[str, Any]  # chat-template kwargs the prompt was rendered with
    prompt_ids: list[int]  # appended with mask 0 before the sampled ids
    input_ids: IdArray  # everything the worker is sent
    experts_start: int = 0  # positions whose routed experts are already stored
    rollback: Rollback | None = None  # set exactly when keep_turns < the segment's turns
    # Set when the turn starts a new segment (keep_turns is then 0 of it).
    branch: Branch | None = None
    # The records of the messages the turn adds (those after the kept ones,
    # all of them in a new segment), encoded when the plan was measured
    # (`turn.limits.keep_bytes`); None: the commit encodes them.
    encoded: tuple[Record, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampled:
    """What a turn records of the engine's validated completion."""

    ids: IdArray  # the sampled ids (loss mask 1)
    logprobs: LogprobArray  # one per sampled id
    message: Message  # the assistant message the history gains
    finish_reason: str | None
    model: str | None  # the model the engine says answered (None: keep the session's)
    weight_version: str | None
    cached_tokens: int | None
    worker: str  # the worker that generated it
    latency_s: float
    # R3: routed-expert ids of the new positions (int32 bytes) and their width.
    experts: tuple[bytes, int] | None = None
    weight_versions: tuple[VersionSpan, ...] = ()  # tiling the sampled ids
    continuations: tuple[Continuation, ...] = ()  # the requests after an abort
    sampling: Mapping[str, Any] | None = None  # what the engine sent (`Turn.sampling`)


def commit_turn(
    session: Session, slot: TurnSlot, plan: TurnPlan, sampled: Sampled, now: float
) -> Turn:
    """Apply the plan: new segment or rollback (if any), prompt delta, sampled
    ids, history."""
    if session.state is not SessionState.OPEN or session.slot is not slot:
        raise SessionClosing(f"session {session.id} was closed during the turn")
    if plan.branch is not None:
        session.start_segment(plan.branch)
    elif plan.rollback is not None:
        session.rollbacks.append(replace(plan.rollback, created_at=now))
    trajectory = session.trajectory
    # Messages up to the kept turn keep the form first stored (equal to the
    # request's under the comparison rules); the journal records only the rest.
    kept = trajectory.turns[plan.keep_turns - 1].messages_end if plan.keep_turns else 0
    start = trajectory.length_after(plan.keep_turns)
    if start + len(plan.prompt_ids) != len(plan.input_ids):
        raise InvariantViolated(f"session {session.id}: planned prompt does not match its ids")
    completion_start = start + len(plan.prompt_ids)
    turn = Turn(
        index=plan.keep_turns,
        prompt_start=start,
        completion_start=completion_start,
        completion_end=completion_start + len(sampled.ids),
        messages_end=len(plan.messages) + 1,
        finish_reason=sampled.finish_reason,
        worker=sampled.worker,
        weight_version=sampled.weight_version,
        cached_tokens=sampled.cached_tokens,
        upstream_latency_s=sampled.latency_s,
        created_at=now,
        weight_versions=sampled.weight_versions,
        continuations=sampled.continuations,
        sampling=sampled.sampling,
    )
    trajectory.commit(
        keep_turns=plan.keep_turns,
        prompt_ids=plan.prompt_ids,
        sampled_ids=sampled.ids,
        sampled_logprobs=sampled.logprobs,
        turn=turn,
        experts=sampled.experts[0] if sampled.experts else None,
        experts_width=sampled.experts[1] if sampled.experts else None,
    )
    # Only the new messages are encoded: O(new), not O(history).
    # The plan's own were encoded when it was measured (after `kept`, as here).
    new = (
        [sampled.message] if plan.encoded is not None else [*plan.messages[kept:], sampled.message]
    )
    session.conversation = session.conversation.spliced(kept, new, encoded=plan.encoded or ())
    session.tools = plan.tools
    session.template_kwargs = plan.kwargs
    session.model = sampled.model or session.model
    return turn


class CommitUndo(NamedTuple):
    """A session's state before a turn's commit: references, nothing copied
    but what `Trajectory.checkpoint` needs for a rollback. (A tuple: it is
    taken before every journaled commit.)"""

    trajectory: Checkpoint
    current: Segment  # the current segment's fields (a view, nothing copied)
    sealed: int  # segments sealed before the commit
    rollbacks: int  # rollbacks recorded before the commit
    model: str | None

    @classmethod
    def of(cls, session: Session, keep_turns: int) -> CommitUndo:
        """Before a commit keeping `keep_turns` turns of the current segment
        (all of them when the commit starts a new segment)."""
        return cls(
            session.trajectory.checkpoint(keep_turns),
            session.current,
            len(session.earlier),
            len(session.rollbacks),
            session.model,
        )

    @classmethod
    def before(cls, session: Session, plan: TurnPlan) -> CommitUndo:
        """Before committing `plan` (a new segment leaves the current one whole)."""
        keep = len(session.trajectory.turns) if plan.branch is not None else plan.keep_turns
        return cls.of(session, keep)

    def apply(self, session: Session) -> None:
        """Put the session back as it was (the slot is still held: no other
        turn touched it)."""
        if len(session.earlier) > self.sealed:
            session.reopen_segment(session.earlier[-1])
        session.trajectory.undo(self.trajectory)
        session.conversation = self.current.conversation
        session.tools = self.current.tools
        session.template_kwargs = self.current.template_kwargs
        del session.rollbacks[self.rollbacks :]
        session.model = self.model
