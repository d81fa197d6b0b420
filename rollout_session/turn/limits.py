"""A turn's limits: the model's context and ``--max-session-tokens``, and
what a session may keep beyond tokens (``--max-session-mb``).

Token checks. `PromptRoom` is the most prompt tokens a request may bring: the
plan tokenises its new text within it (`prompt.bounded`), so an oversize
body is refused after tokenising about the room's worth of it, not all of
it. `completion_budget` runs on the planned prompt: it refuses what cannot
fit and returns the ``max_tokens`` the worker must be sent so that the
session cap is hard.

Byte checks. Token caps see only what the template renders: reasoning it
drops, names, tool-call ids, template kwargs and every segment's copy of
the history are kept (and journaled) whatever their size. `keep_bytes`
measures what a planned turn would leave the session keeping — encoding
its new messages once, for the commit to store as they are — and refuses it
past the budget before any worker is asked (docs/reliability.md#what-a-session-keeps).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ContextLengthExceeded, SessionTooLarge
from ..session.commit import TurnPlan
from ..session.conversation import encode, record_bytes
from ..session.session import Session, json_bytes, segment_bytes

__all__ = ["PromptRoom", "TurnLimits", "completion_budget", "keep_bytes", "prompt_room"]

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TurnLimits:
    """What a session may keep and a request may carry beyond tokens, fixed
    for the app (`Settings.turn_limits`)."""

    # Bytes of text a session keeps (`Session.stored_bytes`); None: unbounded.
    max_session_bytes: int | None = 64 * _MIB
    # Messages a turn's request may carry (as converted into chat messages).
    max_messages: int = 10_000


def keep_bytes(session: Session, plan: TurnPlan, budget: int | None) -> int:
    """The bytes of text `session` would keep once `plan` commits (its answer
    aside: that is bounded by its tokens), its new messages encoded onto the
    plan (`TurnPlan.encoded`) for the commit; `SessionTooLarge` over
    `budget`. O(the messages the plan adds or drops)."""
    stored = session.trajectory
    if plan.branch is not None:  # the current segment is sealed, a new one holds them all
        kept = 0
        encoded = encode(plan.messages)
        sealed = session.sealed_bytes + segment_bytes(session.current)
        current = record_bytes(encoded)
    else:
        kept = stored.turns[plan.keep_turns - 1].messages_end if plan.keep_turns else 0
        encoded = encode(plan.messages[kept:])
        sealed = session.sealed_bytes
        current = session.conversation.bytes_after(kept, encoded)
    plan.encoded = encoded
    current += json_bytes(plan.tools) + json_bytes(plan.kwargs)
    total = session.metadata_bytes + sealed + current
    if budget is not None and total > budget:
        raise SessionTooLarge(
            f"session {session.id} would keep {total / _MIB:.1f} MiB of text with this "
            f"request's messages (every segment's, rendered or not), over its "
            f"{budget / _MIB:g} MiB (--max-session-mb); nothing was stored",
            param="messages",
        )
    return total


def _limits(context_length: int | None, session_cap: int | None) -> list[tuple[int, str]]:
    named = (
        (context_length, "the model's context"),
        (session_cap, "the session token cap (--max-session-tokens)"),
    )
    return [(limit, what) for limit, what in named if limit is not None]


@dataclass(frozen=True, slots=True)
class PromptRoom:
    """The most prompt tokens a request may have: its smallest limit less
    its ``max_tokens`` (1 when it has none: one token must fit)."""

    tokens: int
    limit: int
    what: str  # which limit, for the refusal
    max_tokens: int

    def refused(self, at_least: int) -> ContextLengthExceeded:
        """The refusal of a prompt holding at least `at_least` tokens."""
        return ContextLengthExceeded(
            f"the prompt holds at least {at_least} tokens; with max_tokens "
            f"{self.max_tokens} that exceeds {self.what} of {self.limit} tokens",
            param="messages",
        )


def prompt_room(
    max_tokens: int | None, *, context_length: int | None, session_cap: int | None
) -> PromptRoom | None:
    """The request's `PromptRoom`, or None when no limit is known."""
    limits = _limits(context_length, session_cap)
    if not limits:
        return None
    limit, what = min(limits)
    wanted = max_tokens or 1
    return PromptRoom(max(limit - wanted, 0), limit, what, wanted)


def completion_budget(
    prompt_tokens: int,
    max_tokens: int | None,
    *,
    context_length: int | None,
    session_cap: int | None,
) -> int | None:
    """The ``max_tokens`` to send the worker (None: the agent's, unchanged).

    A prompt that leaves no room for one token, or an explicit `max_tokens`
    over a limit, is refused (like an OpenAI server's context error). Without
    `max_tokens` the worker may sample to its context's end, so under a
    session cap the request gets what the cap leaves.
    """
    for limit, what in _limits(context_length, session_cap):
        if prompt_tokens + (max_tokens or 1) > limit:
            raise ContextLengthExceeded(
                f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens or 1} "
                f"exceeds {what} of {limit} tokens",
                param="messages",
            )
    if max_tokens is None and session_cap is not None:
        # Not past the context either: a cap above it must not ask for more
        # than the worker can give (SGLang refuses such a request).
        room = session_cap if context_length is None else min(session_cap, context_length)
        return room - prompt_tokens
    return None
