"""Planning a turn: extension, retry, rollback or a new segment, and the
prompt ids (docs/api.md#history-rules, docs/training.md#segments).

`plan_turn` is pure: it reads the session and the request and returns what
the turn will commit if the worker answers well, touching nothing else. It
takes exactly what planning needs — the tokenizer and a `TurnPolicy` drawn
from the settings — so unit tests and benches call it directly.

A later turn's prompt is token-in/token-out (the stored ids, then the
junction: `prompt.tokenizer`), or the whole request rendered: under
``--prompt-mode render``, and on a turn of a template whose appended
messages depend on the history (`TurnPolicy.rendered_whole`, from the
start-up check) that they render otherwise after this history than the
junction has them (docs/templates.md#history-dependent-templates).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidRequest, InvariantViolated, TooManySegments, TrajectoryDiverged
from ..prompt.bounded import PromptTooLong
from ..prompt.junction import STOPPED, continuation, shared_prefix
from ..prompt.messages import Message
from ..prompt.tokenizer import ChatTokenizer
from ..session.commit import TurnPlan
from ..session.segments import Branch, Divergence, OnDivergence, PromptMode, Rollback
from ..session.session import Session
from ..session.trajectory import Turn
from .interrupted import OnAbort
from .limits import PromptRoom
from .request import ChatRequest
from .sampling import OnSamplingConflict

__all__ = ["TurnPolicy", "plan_turn"]


@dataclass(frozen=True, slots=True)
class TurnPolicy:
    """The settings a turn follows, fixed for the app. `plan_turn` reads the
    first seven; the turn runner the rest."""

    # Roles an agent may append after an answer and the segment goes on:
    # --append-roles, plus those the start-up template check found the
    # template renders in place exactly (`with_in_place_roles`).
    append_roles: frozenset[str]
    max_rollback_turns: int  # turns a divergent request may drop (ROLLBACK only)
    chat_template_kwargs: Mapping[str, Any]  # defaults under each request's own
    on_divergence: OnDivergence = OnDivergence.SEGMENT
    prompt_mode: PromptMode = PromptMode.TITO
    # The templates (by name; None: the only one) whose appended messages the
    # start-up check found depend on the history: each turn asks whether
    # this history is one they do, and then renders the whole request.
    rendered_whole: frozenset[str | None] = frozenset()
    max_segments: int = 1000  # segments per session (they bound its memory)
    max_session_tokens: int | None = None  # prompt + max_tokens cap per session
    default_priority: int | None = None  # SGLang priority of sessions created without one
    routed_experts: bool = False  # ask for and store routed experts (R3)
    on_abort: OnAbort = OnAbort.CONTINUE  # a worker's abort answer
    max_continuations: int = 8  # requests a turn may add after aborts
    # An agent value that differs from its session's pinned sampling.
    on_sampling_conflict: OnSamplingConflict = OnSamplingConflict.OVERRIDE


def _diverged_roles(new: list[Message], allowed: frozenset[str], offset: int) -> int | None:
    for i, message in enumerate(new):
        if message["role"] not in allowed:
            return offset + i
    return None


def plan_turn(
    session: Session,
    request: ChatRequest,
    tokenizer: ChatTokenizer,
    policy: TurnPolicy,
    room: PromptRoom | None = None,
) -> TurnPlan:
    """Decide how the request continues the session and build the prompt ids
    (no mutation): extend the current segment, replace its last turn (a
    retry), roll back (--on-divergence rollback) or start a new segment.
    A prompt that cannot fit `room` is refused having tokenised about the
    room's worth of the request's new text, however long it is."""
    try:
        return _plan(session, request, _Prompter(tokenizer, room), policy)
    except PromptTooLong as exc:
        if room is None:  # not raised: nothing was bounded
            raise
        raise room.refused(exc.at_least) from None


@dataclass(frozen=True, slots=True)
class _Prompter:
    """The tokenizer, and the room the plan's prompt must fit."""

    tok: ChatTokenizer
    room: PromptRoom | None

    def most(self, base: int) -> int | None:
        """Tokens the text rendered after `base` kept ids may hold."""
        return None if self.room is None else self.room.tokens - base

    def first_turn(self, request: ChatRequest, kwargs: dict[str, Any]) -> list[int]:
        return self.tok.first_turn(
            request.messages, tools=request.tools, kwargs=kwargs, most=self.most(0)
        )


def _plan(
    session: Session, request: ChatRequest, prompter: _Prompter, policy: TurnPolicy
) -> TurnPlan:
    trajectory = session.trajectory
    problem = trajectory.check()
    if problem is not None:
        raise InvariantViolated(f"session {session.id}: trajectory corrupt: {problem}")
    kwargs = {**policy.chat_template_kwargs, **request.chat_template_kwargs}
    turns = trajectory.turns
    if not turns:  # the session's first turn
        return _from_scratch(request, prompter, kwargs)
    incoming = request.messages
    stored = session.conversation
    # The tools are part of the first rendered prompt: changing them is a
    # divergence at the very start of the history.
    shared = stored.common_prefix(incoming) if request.tools == session.tools else 0
    if shared == len(stored):
        if len(incoming) == shared:
            raise InvalidRequest(
                "messages add nothing after the assistant's last answer", param="messages"
            )
        bad = _diverged_roles(incoming[shared:], policy.append_roles, shared)
        if bad is None:
            return _continue(session, request, prompter, policy, kwargs, len(turns), None)
        if policy.on_divergence is not OnDivergence.SEGMENT:
            raise InvalidRequest(
                f"messages[{bad}] has role {incoming[bad]['role']!r}; after the assistant's "
                f"answer only {sorted(policy.append_roles)} may be appended",
                param=f"messages[{bad}].role",
            )
        return _new_segment(
            session, request, prompter, policy, kwargs, Divergence.APPENDED_ROLE, bad
        )
    reason = _divergence(session, request, shared)
    segment = len(session.earlier)
    if reason is Divergence.RETRY:
        keep = len(turns) - 1
        rollback = Rollback(reason, segment, keep, 1, _sampled_after(turns, keep), shared)
        return _continue(session, request, prompter, policy, kwargs, keep, rollback)
    if policy.on_divergence is OnDivergence.SEGMENT:
        return _new_segment(session, request, prompter, policy, kwargs, reason, shared)
    if policy.on_divergence is OnDivergence.ERROR:
        raise TrajectoryDiverged(
            f"messages diverge from the session's history at message {shared} "
            f"({reason.value}); with --on-divergence error a request must extend the "
            "session's history or repeat its previous request",
            param="messages",
        )
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
    rollback = Rollback(reason, segment, keep, dropped, _sampled_after(turns, keep), shared)
    return _continue(session, request, prompter, policy, kwargs, keep, rollback)


def _sampled_after(turns: list[Turn], keep: int) -> int:
    """Sampled tokens of the turns a rollback keeping `keep` drops."""
    return sum(t.completion_end - t.completion_start for t in turns[keep:])


def _from_scratch(
    request: ChatRequest,
    prompter: _Prompter,
    kwargs: dict[str, Any],
    *,
    rollback: Rollback | None = None,
    branch: Branch | None = None,
    prompt: list[int] | None = None,
) -> TurnPlan:
    """A turn whose prompt is the template's render of the whole request: a
    session's first, a new segment's first, or a replaced first turn."""
    if prompt is None:
        prompt = prompter.first_turn(request, kwargs)
    return TurnPlan(
        0,
        request.messages,
        request.tools,
        kwargs,
        prompt,
        np.asarray(prompt, np.int32),
        rollback=rollback,
        branch=branch,
    )


def _new_segment(
    session: Session,
    request: ChatRequest,
    prompter: _Prompter,
    policy: TurnPolicy,
    kwargs: dict[str, Any],
    reason: Divergence,
    message: int,
    prompt: list[int] | None = None,
) -> TurnPlan:
    segment = len(session.earlier)
    if segment + 1 >= policy.max_segments:
        raise TooManySegments(
            f"messages diverge from the session's history at message {message} "
            f"({reason.value}), and the session has its --max-segments "
            f"({policy.max_segments}) segments already; it takes only extensions of "
            "its last segment and retries now",
            param="messages",
        )
    branch = Branch(reason, segment, message)
    return _from_scratch(request, prompter, kwargs, branch=branch, prompt=prompt)


def _continue(
    session: Session,
    request: ChatRequest,
    prompter: _Prompter,
    policy: TurnPolicy,
    kwargs: dict[str, Any],
    keep: int,
    rollback: Rollback | None,
) -> TurnPlan:
    """Keep `keep` turns of the current segment and append the request's
    messages after them."""
    if keep == 0:
        return _from_scratch(request, prompter, kwargs, rollback=rollback)
    if policy.prompt_mode is PromptMode.RENDER:
        return _rendered(session, request, prompter, policy, kwargs, keep, rollback)
    trajectory = session.trajectory
    last = trajectory.turns[keep - 1]
    answer = last.messages_end - 1
    previous = session.conversation.message(answer)
    new = request.messages[last.messages_end :]
    tok = prompter.tok
    if tok.template_for(request.tools).name in policy.rendered_whole and not tok.appends_alike(
        request.messages[:answer], previous, new, tools=request.tools, kwargs=kwargs
    ):
        # The junction would append what no render of this conversation holds.
        return _rendered(session, request, prompter, policy, kwargs, keep, rollback, whole=True)
    base = trajectory.length_after(keep)
    try:
        junction = tok.junction(
            previous,
            new,
            tools=request.tools,
            kwargs=kwargs,
            most=prompter.most(base),
        )
    except PromptTooLong as exc:
        raise PromptTooLong(base + exc.at_least) from None
    prompt = continuation(
        trajectory.sampled_ids(keep - 1),
        junction,
        stopped=last.finish_reason in STOPPED,
        special_ids=tok.special_ids,
    )
    input_ids = trajectory.tokens.prefix_ids(base, prompt)
    return TurnPlan(
        keep,
        request.messages,
        request.tools,
        kwargs,
        prompt,
        input_ids,
        trajectory.expert_positions(keep),
        rollback,
    )


def _rendered(
    session: Session,
    request: ChatRequest,
    prompter: _Prompter,
    policy: TurnPolicy,
    kwargs: dict[str, Any],
    keep: int,
    rollback: Rollback | None,
    *,
    whole: bool = False,
) -> TurnPlan:
    """The whole request rendered (--prompt-mode render, or `whole`: a turn
    whose appended messages the template renders from the history); it
    continues the kept turns only if it starts with their ids exactly."""
    trajectory = session.trajectory
    full = prompter.first_turn(request, kwargs)
    base = trajectory.length_after(keep)
    input_ids = np.asarray(full, np.int32)
    kept_ids = trajectory.tokens.prefix_ids(base)
    if len(full) > base and np.array_equal(input_ids[:base], kept_ids):
        return TurnPlan(
            keep,
            request.messages,
            request.tools,
            kwargs,
            full[base:],
            input_ids,
            trajectory.expert_positions(keep),
            rollback,
        )
    # Where the render first differs: in a turn's answer, that answer; in a
    # turn's prompt, the first message that prompt added (token positions are
    # kept per turn, not per message: the earliest message that can hold it).
    differs = shared_prefix(full, kept_ids.tolist())
    turns = trajectory.turns
    turn = next((t for t in turns[:keep] if t.completion_end > differs), turns[keep - 1])
    if differs >= turn.completion_start:
        message = turn.messages_end - 1
    else:
        message = turns[turn.index - 1].messages_end if turn.index else 0
    if policy.on_divergence is not OnDivergence.SEGMENT:
        mode = (
            "the template writes the appended messages from the history, so the turn is "
            "rendered whole, and"
            if whole
            else "--prompt-mode render with"
        )
        raise TrajectoryDiverged(
            "the chat template renders this request's history differently from the "
            f"session's tokens (in message {message}); {mode} "
            f"--on-divergence {policy.on_divergence.value} cannot continue it",
            param="messages",
        )
    return _new_segment(
        session, request, prompter, policy, kwargs, Divergence.RENDERED_DIFFERENTLY, message, full
    )


def _divergence(session: Session, request: ChatRequest, shared: int) -> Divergence:
    """Name why a request that does not extend the current segment diverges
    at message `shared` (segments.Divergence)."""
    stored = session.conversation
    if request.tools != session.tools:
        return Divergence.TOOLS_CHANGED
    # The previous request exactly: the stored history without the last
    # answer (not merely a prefix of it: that is an edit).
    if shared == len(request.messages) == len(stored) - 1:
        answer = stored.message(shared)
        # An agent that got nothing usable and asks again saw the answer: it
        # is kept in its segment rather than replaced.
        if answer.get("content") or answer.get("tool_calls"):
            return Divergence.RETRY
        return Divergence.ANSWER_DROPPED
    if shared < len(stored) and stored.message(shared)["role"] == "assistant":
        if shared < len(request.messages) and request.messages[shared]["role"] == "assistant":
            return Divergence.ANSWER_EDITED
        return Divergence.ANSWER_DROPPED
    return Divergence.HISTORY_EDITED
