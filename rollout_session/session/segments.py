"""Segments: a session's trajectory as a list of linear token sequences
(docs/training.md#segments).

A request that extends the current segment extends it. A request that does
not (an agent that dropped or edited an answer, changed its tools, injected
a message its template does not render in place, re-formatted its history or
compacted it) starts a new segment rendered from that request; every earlier
segment stays whole, so no sampled token leaves the trajectory. A request
that repeats the previous one (the agent never saw the answer) replaces the
last turn instead: a `Rollback` with reason ``retry``, recorded like every
rollback (``--on-divergence rollback`` makes the older rule, bounded
rollbacks, the policy).

The current segment is the session's own ``trajectory``, ``conversation``,
``tools`` and ``template_kwargs`` (the turn path reads nothing else); the
earlier ones are sealed `Segment` records, never changed again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # config imports the enums: keep this module light
    from .conversation import Conversation
    from .trajectory import Trajectory

__all__ = ["Branch", "Divergence", "OnDivergence", "PromptMode", "Rollback", "Segment"]


class OnDivergence(enum.Enum):
    """What a request that does not extend the current segment does (and is
    not a retry, which always replaces the last turn)."""

    # Starts a new segment: earlier segments keep every sampled token.
    SEGMENT = "segment"
    # Rolls back to the last turn the request still matches, dropping at most
    # --max-rollback-turns turns (their sampled tokens leave the trajectory,
    # recorded); beyond that 400 trajectory_diverged.
    ROLLBACK = "rollback"
    # 400 trajectory_diverged: one linear sequence per session, strictly.
    ERROR = "error"


class PromptMode(enum.Enum):
    """How a later turn's prompt is built."""

    # Token-in/token-out: the stored ids, then only the new messages rendered
    # (O(new tokens)); the model's sampled ids are never re-tokenised.
    TITO = "tito"
    # The template renders the whole request (O(history)); it extends the
    # segment when it starts with the segment's ids, else starts a new one.
    RENDER = "render"


class Divergence(enum.Enum):
    """Why a request does not extend the current segment (the reason codes of
    the export, the log and ``rollout_*_total{reason}``)."""

    # The previous request again: its answer never reached the agent.
    RETRY = "retry"
    # Other tools than the segment's (they are part of its first prompt).
    TOOLS_CHANGED = "tools_changed"
    # The history stops matching at one of the model's answers, which the
    # request leaves out (an empty or reasoning-only answer, one without the
    # tool call the agent wanted), or the request repeats the previous one
    # after an answer with neither content nor tool calls (the agent saw it:
    # nothing in it to keep).
    ANSWER_DROPPED = "answer_dropped"
    # ... or has another assistant message there (tool calls re-sent as
    # text, an answer edited or summarised).
    ANSWER_EDITED = "answer_edited"
    # It stops matching at any other message (edited, compacted, summarised).
    HISTORY_EDITED = "history_edited"
    # The history matches, but an appended message has a role the template
    # does not render in place (e.g. a mid-conversation system message).
    APPENDED_ROLE = "appended_role"
    # A turn rendered whole (--prompt-mode render, or a template whose
    # appended messages depend on the history) whose render differs from the
    # segment's ids (it rewrites earlier turns, or re-tokenises an answer).
    RENDERED_DIFFERENTLY = "rendered_differently"


@dataclass(frozen=True, slots=True)
class Branch:
    """Where a segment came from: the segment the request was compared with
    (always the one before it) and the first message that differs."""

    reason: Divergence
    segment: int
    message: int

    def as_dict(self) -> dict[str, Any]:
        return {"reason": self.reason.value, "segment": self.segment, "message": self.message}

    @classmethod
    def of(cls, raw: dict[str, Any]) -> Branch:
        return cls(Divergence(raw["reason"]), int(raw["segment"]), int(raw["message"]))


@dataclass(frozen=True, slots=True)
class Rollback:
    """Turns replaced in place: their sampled tokens left the trajectory (a
    retry's answer never reached the agent; under --on-divergence rollback,
    any bounded rollback). Recorded per session, logged and counted."""

    reason: Divergence
    segment: int  # the segment the turns were dropped from
    turn: int  # index of the first dropped turn (and of the turn replacing them)
    dropped_turns: int
    dropped_tokens: int  # the sampled tokens of the dropped turns
    message: int  # the first message that differs from the stored history
    created_at: float = 0.0  # set when the turn commits

    def as_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason.value,
            "segment": self.segment,
            "turn": self.turn,
            "dropped_turns": self.dropped_turns,
            "dropped_tokens": self.dropped_tokens,
            "message": self.message,
            "created_at": self.created_at,
        }

    @classmethod
    def of(cls, raw: dict[str, Any]) -> Rollback:
        return cls(
            Divergence(raw["reason"]),
            int(raw["segment"]),
            int(raw["turn"]),
            int(raw["dropped_turns"]),
            int(raw["dropped_tokens"]),
            int(raw["message"]),
            float(raw["created_at"]),
        )


@dataclass(frozen=True, slots=True)
class Segment:
    """A sealed segment: what the session's current-segment fields held when
    a request started the next one. Never changed again."""

    trajectory: Trajectory
    conversation: Conversation
    tools: list[Any] | None
    template_kwargs: dict[str, Any] | None
    branch: Branch | None  # None for a session's first segment
