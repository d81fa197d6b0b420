"""Planning a turn: extension or rollback, and the prompt ids (docs/api.md#history-rules).

`plan_turn` is pure: it reads the session and the request and returns what
the turn will commit if the worker answers well, touching nothing else. It
takes exactly what planning needs — the tokenizer and a `TurnPolicy` drawn
from the settings — so unit tests and benches call it directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import Settings
from .errors import InvalidRequest, InvariantViolated, TrajectoryDiverged
from .messages import Message
from .prompt.junction import STOPPED, continuation
from .protocol import ChatRequest
from .sessions import Session
from .tokenization import ChatTokenizer
from .turn_commit import Rollback, TurnPlan

__all__ = ["TurnPolicy", "plan_turn"]


@dataclass(frozen=True, slots=True)
class TurnPolicy:
    """The settings a turn follows, fixed for the app. `plan_turn` reads the
    first three; the turn runner the rest."""

    append_roles: frozenset[str]  # roles an agent may append after an answer
    max_rollback_turns: int  # turns a divergent request may drop
    chat_template_kwargs: Mapping[str, Any]  # defaults under each request's own
    max_session_tokens: int | None = None  # prompt + max_tokens cap per session
    session_cache: bool = False  # send SGLang the session id (--sglang-session-cache)
    routed_experts: bool = False  # ask for and store routed experts (R3)

    @classmethod
    def of(cls, settings: Settings) -> TurnPolicy:
        return cls(
            append_roles=settings.append_roles,
            max_rollback_turns=settings.max_rollback_turns,
            chat_template_kwargs=settings.chat_template_kwargs,
            max_session_tokens=settings.max_session_tokens,
            session_cache=settings.sglang_session_cache,
            routed_experts=settings.routed_experts,
        )


def _diverged_roles(new: list[Message], allowed: frozenset[str], offset: int) -> int | None:
    for i, message in enumerate(new):
        if message["role"] not in allowed:
            return offset + i
    return None


def plan_turn(
    session: Session, request: ChatRequest, tokenizer: ChatTokenizer, policy: TurnPolicy
) -> TurnPlan:
    """Decide extension or rollback and build the prompt ids (no mutation)."""
    trajectory = session.trajectory
    problem = trajectory.check()
    if problem is not None:
        raise InvariantViolated(f"session {session.id}: trajectory corrupt: {problem}")
    kwargs = {**policy.chat_template_kwargs, **request.chat_template_kwargs}
    turns = trajectory.turns
    incoming = request.messages
    # The tools are part of the first rendered prompt: changing them is a
    # divergence at the very start of the history.
    stored = session.conversation
    shared = stored.common_prefix(incoming) if request.tools == session.tools else 0
    if turns and shared == len(stored):
        keep = len(turns)
        if len(incoming) == shared:
            raise InvalidRequest(
                "messages add nothing after the assistant's last answer", param="messages"
            )
        bad = _diverged_roles(incoming[shared:], policy.append_roles, shared)
        if bad is not None:
            raise InvalidRequest(
                f"messages[{bad}] has role {incoming[bad]['role']!r}; after the assistant's "
                f"answer only {sorted(policy.append_roles)} may be appended",
                param=f"messages[{bad}].role",
            )
    else:
        keep = sum(1 for t in turns if t.messages_end <= shared)
        dropped = len(turns) - keep
        first_retry = keep == 0 and len(turns) == 1
        if dropped > policy.max_rollback_turns and not first_retry:
            raise TrajectoryDiverged(
                f"messages diverge from the session's history at message {shared}; "
                f"that would roll back {dropped} turns (max {policy.max_rollback_turns})",
                param="messages",
            )
        if keep:
            start = turns[keep - 1].messages_end
            bad = _diverged_roles(incoming[start:], policy.append_roles, start)
            if len(incoming) == start or bad is not None:
                raise TrajectoryDiverged(
                    f"messages diverge from the session's history at message {shared} and "
                    "do not continue its last kept answer with "
                    f"{sorted(policy.append_roles)} messages",
                    param="messages",
                )
    rollback = _rollback(session, request, shared, keep) if keep < len(turns) else None
    if keep == 0:
        prompt = tokenizer.first_turn(incoming, tools=request.tools, kwargs=kwargs)
        return TurnPlan(
            0,
            incoming,
            request.tools,
            kwargs,
            prompt,
            np.asarray(prompt, np.int32),
            rollback=rollback,
        )
    last = turns[keep - 1]
    junction = tokenizer.junction(
        stored.message(last.messages_end - 1),
        incoming[last.messages_end :],
        tools=request.tools,
        kwargs=kwargs,
    )
    prompt = continuation(
        trajectory.sampled_ids(keep - 1),
        junction,
        stopped=last.finish_reason in STOPPED,
        special_ids=tokenizer.special_ids,
    )
    input_ids = trajectory.tokens.prefix_ids(trajectory.length_after(keep), prompt)
    return TurnPlan(
        keep,
        incoming,
        request.tools,
        kwargs,
        prompt,
        input_ids,
        trajectory.expert_positions(keep),
        rollback,
    )


def _rollback(session: Session, request: ChatRequest, shared: int, keep: int) -> Rollback:
    """Name why a request drops turns `keep`… of the session (module doc)."""
    stored = session.conversation
    dropped = len(session.trajectory.turns) - keep
    if request.tools != session.tools:
        return Rollback("tools_changed", dropped, 0)
    # The previous request: the stored history without the last answer.
    if shared == len(request.messages) == len(stored) - 1:
        return Rollback("retry", dropped, shared)
    if shared < len(stored) and stored.message(shared)["role"] == "assistant":
        return Rollback("answer_dropped", dropped, shared)
    return Rollback("history_edited", dropped, shared)
