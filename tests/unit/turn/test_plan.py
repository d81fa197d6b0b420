"""`plan_turn`: extension, retry, rollback or new segment, and the exact
prompt ids (docs/api.md#history-rules, docs/training.md#segments).

Drives `plan_turn` and `commit_turn` in-process with the bundled ChatML
tokenizer. Each turn's sampled ids are given (the template's own
tokenisation of the answer unless a test says otherwise), so every expected
id, index and count below is derived from the rules, not read back.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollout_session.emulator import bundled_tokenizer_path
from rollout_session.errors import (
    InvalidRequest,
    InvariantViolated,
    TemplateCannotExtend,
    TooManySegments,
    TrajectoryDiverged,
)
from rollout_session.prompt.messages import Message, assistant_message
from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer
from rollout_session.session.commit import Sampled, TurnPlan, commit_turn
from rollout_session.session.segments import (
    Branch,
    Divergence,
    OnDivergence,
    PromptMode,
    Rollback,
)
from rollout_session.session.session import Session, SessionRegistry
from rollout_session.session.trajectory import Turn
from rollout_session.turn.plan import TurnPolicy, plan_turn
from rollout_session.turn.request import ChatRequest, chat_request
from tests import FIXTURES

# The bundled vocabulary's ChatML markers (single special tokens).
IM_START = 128000
IM_END = 128001

POLICY = TurnPolicy(
    append_roles=frozenset({"tool", "user"}),
    max_rollback_turns=1,
    chat_template_kwargs={},
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
ALL_POLICIES = [OnDivergence.SEGMENT, OnDivergence.ROLLBACK, OnDivergence.ERROR]
POLICY_IDS = [p.value for p in ALL_POLICIES]


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


U0 = user("Start.")
A0 = assistant("Hello there.")
U1 = user("Next.")
A1 = assistant("Done.")
U2 = user("More.")
# The prompt delta after a ChatML answer that ended on its sampled <|im_end|>:
# the rest of the history terminator, the new messages, the generation prompt.
AFTER_ANSWER = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return load_tokenizer(bundled_tokenizer_path(), "chatml")


def policy(**changes: Any) -> TurnPolicy:
    return replace(POLICY, **changes)


def request(messages: list[Message], **fields: Any) -> ChatRequest:
    # Not the conversation checks of parse_chat_request: plans of any shape.
    return chat_request({"model": "m", "messages": messages, **fields})


def sampled_ids(tok: ChatTokenizer, answer: Message) -> list[int]:
    """What a model sampling `answer` produced: the template's tokenisation
    of its content, then the stop token."""
    return [*tok.encode(str(answer["content"])), IM_END]


def commit(
    session: Session,
    plan: TurnPlan,
    ids: list[int],
    answer: Message,
    *,
    finish_reason: str = "stop",
    now: float = 1.0,
) -> Turn:
    """Commit `plan` with `ids` sampled, as the turn runner does (slot held)."""
    slot = session.claim(now)
    sampled = Sampled(
        ids=np.asarray(ids, np.int32),
        logprobs=np.full(len(ids), -0.5, np.float32),
        message=assistant_message(
            answer.get("content"), answer.get("tool_calls") or [], answer.get("reasoning_content")
        ),
        finish_reason=finish_reason,
        model=None,
        weight_version=None,
        cached_tokens=None,
        worker="http://w",
        latency_s=0.0,
    )
    try:
        return commit_turn(session, slot, plan, sampled, now)
    finally:
        session.release(slot, now)


def new_session() -> Session:
    return SessionRegistry(clock=lambda: 0.0).create("s")


def one_turn(tok: ChatTokenizer, ids: list[int] | None = None) -> Session:
    """A session after [U0] → A0 (stored: U0, A0)."""
    session = new_session()
    plan = plan_turn(session, request([U0]), tok, POLICY)
    commit(session, plan, sampled_ids(tok, A0) if ids is None else ids, A0)
    return session


def two_turns(
    tok: ChatTokenizer, ids0: list[int] | None = None, ids1: list[int] | None = None
) -> Session:
    """A session after [U0] → A0, [U0, A0, U1] → A1 (stored: U0, A0, U1, A1)."""
    session = one_turn(tok, ids0)
    plan = plan_turn(session, request([U0, A0, U1]), tok, POLICY)
    commit(session, plan, sampled_ids(tok, A1) if ids1 is None else ids1, A1, now=2.0)
    return session


def odd_ids(tok: ChatTokenizer, answer: Message) -> list[int]:
    """Ids a model may sample for `answer` that are not the tokenizer's own
    split of its content (its first two characters apart)."""
    text = str(answer["content"])
    ids = [*tok.encode(text[:2]), *tok.encode(text[2:]), IM_END]
    assert ids != sampled_ids(tok, answer)
    return ids


def stored_ids(session: Session) -> list[int]:
    ids: list[int] = session.trajectory.tokens.ids.tolist()
    return ids


def assert_from_scratch(plan: TurnPlan, tok: ChatTokenizer, req: ChatRequest) -> None:
    """A plan whose prompt is the template's render of the whole request."""
    expected = tok.first_turn(req.messages, tools=req.tools, kwargs={})
    assert plan.keep_turns == 0
    assert plan.prompt_ids == expected
    assert plan.input_ids.dtype == np.int32
    assert plan.input_ids.tolist() == expected
    assert plan.experts_start == 0
    assert plan.messages == req.messages


# --- first turn ---------------------------------------------------------------


def test_bundled_chatml_markers(tok: ChatTokenizer) -> None:
    assert tok.encode("<|im_start|><|im_end|>") == [IM_START, IM_END]
    assert IM_END in tok.stop_ids


@pytest.mark.parametrize(
    ("messages", "tools"),
    [
        ([U0], None),
        ([{"role": "system", "content": "Be brief."}, U0], None),
        ([U0], TOOLS),
    ],
    ids=["user", "system-user", "with-tools"],
)
@pytest.mark.parametrize("mode", list(PromptMode), ids=[m.value for m in PromptMode])
def test_first_turn_is_the_render_with_generation_prompt(
    tok: ChatTokenizer, messages: list[Message], tools: list[Any] | None, mode: PromptMode
) -> None:
    req = request(messages, tools=tools)
    plan = plan_turn(new_session(), req, tok, policy(prompt_mode=mode))
    assert_from_scratch(plan, tok, req)
    assert plan.rollback is None and plan.branch is None
    assert plan.tools == tools
    assert plan.kwargs == {}
    text = tok.render(req.messages, tools=tools, kwargs={}, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert plan.prompt_ids == tok.encode(text)


def test_first_turn_ids_exactly(tok: ChatTokenizer) -> None:
    plan = plan_turn(new_session(), request([U0]), tok, POLICY)
    # <|im_start|>user\nStart.<|im_end|>\n<|im_start|>assistant\n
    assert plan.prompt_ids == [
        IM_START,
        5265,
        201,
        13298,
        16,
        IM_END,
        201,
        IM_START,
        624,
        15059,
        201,
    ]


def test_template_kwargs_merge_request_over_policy(tok: ChatTokenizer) -> None:
    pol = policy(chat_template_kwargs={"a": 1, "b": 1})
    plan = plan_turn(new_session(), request([U0], chat_template_kwargs={"b": 2}), tok, pol)
    assert plan.kwargs == {"a": 1, "b": 2}


def test_corrupt_trajectory_is_an_invariant_violation(tok: ChatTokenizer) -> None:
    session = one_turn(tok)
    session.trajectory.turns.clear()  # tokens without the turns that cover them
    with pytest.raises(InvariantViolated, match="trajectory corrupt"):
        plan_turn(session, request([U0, A0, U1]), tok, POLICY)


# --- extension ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("finish_reason", "stopped", "appended", "delta"),
    [
        ("stop", True, [U1], AFTER_ANSWER.format("Next.")),
        # Cut by max_tokens: no <|im_end|> sampled, so the whole terminator follows.
        ("length", False, [U1], "<|im_end|>" + AFTER_ANSWER.format("Next.")),
        (
            "stop",
            True,
            [{"role": "tool", "tool_call_id": "c1", "content": "out"}],
            "\n<|im_start|>tool\n<tool_response>\nout\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            "stop",
            True,
            [U1, U2],
            "\n<|im_start|>user\nNext.<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
    ],
    ids=["user-after-stop", "user-after-length", "tool", "two-users"],
)
def test_extension_keeps_every_turn_and_appends_only_the_new_messages(
    tok: ChatTokenizer,
    finish_reason: str,
    stopped: bool,
    appended: list[Message],
    delta: str,
) -> None:
    session = new_session()
    first = plan_turn(session, request([U0]), tok, POLICY)
    answer = sampled_ids(tok, A0) if stopped else tok.encode("Hello there.")
    turn = commit(session, first, answer, A0, finish_reason=finish_reason)
    assert (turn.prompt_start, turn.completion_start) == (0, len(first.prompt_ids))
    assert turn.completion_end == len(first.prompt_ids) + len(answer)
    assert turn.messages_end == 2
    stored = stored_ids(session)
    assert stored == first.prompt_ids + answer  # prompt + sampled, as they were

    req = request([U0, A0, *appended])
    plan = plan_turn(session, req, tok, POLICY)
    assert plan.keep_turns == 1
    assert plan.rollback is None and plan.branch is None
    assert plan.prompt_ids == tok.encode(delta)
    assert plan.input_ids.dtype == np.int32
    assert plan.input_ids.tolist() == stored + plan.prompt_ids
    assert plan.experts_start == len(stored) - 1
    assert plan.messages == req.messages


def test_extension_after_two_turns(tok: ChatTokenizer) -> None:
    session = two_turns(tok)
    stored = stored_ids(session)
    [t0, t1] = session.trajectory.turns
    assert t1.prompt_start == t0.completion_end and t1.completion_end == len(stored)
    assert stored[t1.completion_start :] == sampled_ids(tok, A1)
    plan = plan_turn(session, request([U0, A0, U1, A1, U2]), tok, POLICY)
    assert plan.keep_turns == 2
    assert plan.rollback is None and plan.branch is None
    assert plan.prompt_ids == tok.encode(AFTER_ANSWER.format("More."))
    assert plan.input_ids.tolist() == stored + plan.prompt_ids
    assert plan.experts_start == len(stored) - 1


def test_sampled_ids_are_never_re_tokenised(tok: ChatTokenizer) -> None:
    # "Hel" + "lo there." is not how the tokenizer splits "Hello there.".
    odd = [*tok.encode("Hel"), *tok.encode("lo there."), IM_END]
    assert odd != sampled_ids(tok, A0)
    session = one_turn(tok, odd)
    stored = stored_ids(session)
    plan = plan_turn(session, request([U0, A0, U1]), tok, POLICY)
    assert plan.keep_turns == 1 and plan.branch is None
    assert plan.input_ids.tolist()[: len(stored)] == stored
    assert plan.input_ids.tolist()[len(stored) - len(odd) : len(stored)] == odd
    assert plan.prompt_ids == tok.encode(AFTER_ANSWER.format("Next."))
    # A re-render would have tokenised the answer its own way.
    render = tok.first_turn(request([U0, A0, U1]).messages, tools=None, kwargs={})
    assert plan.input_ids.tolist() != render


def test_tool_call_answer_then_tool_result(tok: ChatTokenizer) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'},
    }
    answer: Message = {"role": "assistant", "content": None, "tool_calls": [call]}
    ids = [
        *tok.encode(
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
        ),
        IM_END,
    ]
    session = new_session()
    first = plan_turn(session, request([U0], tools=TOOLS), tok, POLICY)
    commit(session, first, ids, answer, finish_reason="tool_calls")
    stored = stored_ids(session)
    result: Message = {"role": "tool", "tool_call_id": "call_1", "content": "file body"}
    plan = plan_turn(session, request([U0, answer, result], tools=TOOLS), tok, POLICY)
    assert plan.keep_turns == 1 and plan.rollback is None and plan.branch is None
    assert plan.prompt_ids == tok.encode(
        "\n<|im_start|>tool\n<tool_response>\nfile body\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert plan.input_ids.tolist() == stored + plan.prompt_ids


@pytest.mark.parametrize("on_divergence", ALL_POLICIES, ids=POLICY_IDS)
def test_request_adding_nothing_is_invalid(tok: ChatTokenizer, on_divergence: OnDivergence) -> None:
    session = one_turn(tok)
    with pytest.raises(InvalidRequest, match="add nothing") as raised:
        plan_turn(session, request([U0, A0]), tok, policy(on_divergence=on_divergence))
    assert raised.type is InvalidRequest
    assert raised.value.param == "messages"


# --- retry --------------------------------------------------------------------


@pytest.mark.parametrize("on_divergence", ALL_POLICIES, ids=POLICY_IDS)
def test_retry_of_the_first_request_replaces_the_turn(
    tok: ChatTokenizer, on_divergence: OnDivergence
) -> None:
    session = new_session()
    first = plan_turn(session, request([U0]), tok, POLICY)
    commit(session, first, sampled_ids(tok, A0), A0)
    req = request([U0])
    assert len(sampled_ids(tok, A0)) == 4
    plan = plan_turn(session, req, tok, policy(on_divergence=on_divergence))
    assert_from_scratch(plan, tok, req)
    assert plan.input_ids.tolist() == first.input_ids.tolist()
    assert plan.branch is None
    assert plan.rollback == Rollback(
        Divergence.RETRY, segment=0, turn=0, dropped_turns=1, dropped_tokens=4, message=1
    )


@pytest.mark.parametrize("on_divergence", ALL_POLICIES, ids=POLICY_IDS)
@pytest.mark.parametrize("mode", list(PromptMode), ids=[m.value for m in PromptMode])
def test_retry_of_a_later_request_keeps_the_turns_before(
    tok: ChatTokenizer, on_divergence: OnDivergence, mode: PromptMode
) -> None:
    session = one_turn(tok)
    kept = stored_ids(session)
    second = plan_turn(session, request([U0, A0, U1]), tok, POLICY)
    commit(session, second, sampled_ids(tok, A1), A1, now=2.0)
    plan = plan_turn(
        session, request([U0, A0, U1]), tok, policy(on_divergence=on_divergence, prompt_mode=mode)
    )
    assert plan.keep_turns == 1
    assert plan.branch is None
    assert plan.rollback == Rollback(Divergence.RETRY, 0, 1, 1, len(sampled_ids(tok, A1)), 3)
    assert plan.prompt_ids == second.prompt_ids == tok.encode(AFTER_ANSWER.format("Next."))
    assert plan.input_ids.tolist() == second.input_ids.tolist() == kept + plan.prompt_ids
    assert plan.experts_start == len(kept) - 1


@pytest.mark.parametrize(
    "answer",
    [
        assistant(""),
        {"role": "assistant", "content": None, "reasoning_content": "Hmm."},
    ],
    ids=["empty", "reasoning-only"],
)
@pytest.mark.parametrize("on_divergence", ALL_POLICIES, ids=POLICY_IDS)
def test_repeat_after_an_answer_without_content_is_answer_dropped(
    tok: ChatTokenizer, answer: Message, on_divergence: OnDivergence
) -> None:
    session = new_session()
    first = plan_turn(session, request([U0]), tok, POLICY)
    commit(session, first, [IM_END], answer)
    req = request([U0])
    pol = policy(on_divergence=on_divergence)
    if on_divergence is OnDivergence.ERROR:
        with pytest.raises(TrajectoryDiverged, match="answer_dropped"):
            plan_turn(session, req, tok, pol)
        return
    plan = plan_turn(session, req, tok, pol)
    assert_from_scratch(plan, tok, req)
    if on_divergence is OnDivergence.SEGMENT:  # the answer stays in its segment
        assert plan.branch == Branch(Divergence.ANSWER_DROPPED, segment=0, message=1)
        assert plan.rollback is None
    else:  # rollback: the one turn is dropped (a one-turn session accepts anything)
        assert plan.branch is None
        assert plan.rollback == Rollback(Divergence.ANSWER_DROPPED, 0, 0, 1, 1, 1)


# --- divergence: new segment (--on-divergence segment) ------------------------

# Against the stored U0, A0, U1, A1: (request, tools, reason, first differing message).
DIVERGENT: list[tuple[list[Message], list[Any] | None, Divergence, int]] = [
    ([U0, A0, U1, A1, U2], TOOLS, Divergence.TOOLS_CHANGED, 0),
    ([U0, A0, U1], TOOLS, Divergence.TOOLS_CHANGED, 0),  # a retry, but with tools
    ([U0, A0, U1, U2], None, Divergence.ANSWER_DROPPED, 3),
    ([U0], None, Divergence.ANSWER_DROPPED, 1),  # the first request again, not the last
    ([U0, A0, U1, assistant("Edited."), U2], None, Divergence.ANSWER_EDITED, 3),
    ([U0, A0, user("Other."), A1, U2], None, Divergence.HISTORY_EDITED, 2),
    ([user("Summary."), user("Go on.")], None, Divergence.HISTORY_EDITED, 0),
    ([U0, A0], None, Divergence.HISTORY_EDITED, 2),  # a prefix ending on an answer
]
DIVERGENT_IDS = [
    "tools-changed",
    "retry-with-other-tools",
    "answer-dropped",
    "first-request-again",
    "answer-edited",
    "history-edited",
    "compacted",
    "prefix-ending-on-answer",
]


@pytest.mark.parametrize(("messages", "tools", "reason", "message"), DIVERGENT, ids=DIVERGENT_IDS)
def test_divergence_starts_a_new_segment(
    tok: ChatTokenizer,
    messages: list[Message],
    tools: list[Any] | None,
    reason: Divergence,
    message: int,
) -> None:
    session = two_turns(tok)
    before = stored_ids(session)
    req = request(messages, tools=tools)
    plan = plan_turn(session, req, tok, POLICY)
    assert_from_scratch(plan, tok, req)
    assert plan.branch == Branch(reason, segment=0, message=message)
    assert plan.rollback is None
    assert plan.tools == tools
    # Planning changed nothing.
    assert stored_ids(session) == before
    assert len(session.trajectory.turns) == 2 and session.earlier == []
    # Committed, the old segment stays whole and the new one starts from the render.
    commit(session, plan, sampled_ids(tok, A1), A1, now=3.0)
    assert [s.trajectory.tokens.ids.tolist() for s in session.earlier] == [before]
    assert session.branch == plan.branch
    assert stored_ids(session) == plan.prompt_ids + sampled_ids(tok, A1)
    assert session.rollbacks == []


@pytest.mark.parametrize(("messages", "tools", "reason", "message"), DIVERGENT, ids=DIVERGENT_IDS)
def test_divergence_under_error_policy_is_refused(
    tok: ChatTokenizer,
    messages: list[Message],
    tools: list[Any] | None,
    reason: Divergence,
    message: int,
) -> None:
    session = two_turns(tok)
    pol = policy(on_divergence=OnDivergence.ERROR)
    with pytest.raises(TrajectoryDiverged) as raised:
        plan_turn(session, request(messages, tools=tools), tok, pol)
    assert raised.value.code == "trajectory_diverged"
    assert raised.value.param == "messages"
    assert f"at message {message} ({reason.value})" in raised.value.message


# --- divergence: bounded rollback (--on-divergence rollback) ------------------

# Against the stored U0, A0, U1, A1, whose answers sampled 4 and 3 ids:
# (request, tools, max_rollback_turns, reason, kept turns, dropped turns,
#  dropped sampled ids, first differing message, prompt delta after A0 or
#  None for a render of the whole request).
ROLLBACKS: list[
    tuple[list[Message], list[Any] | None, int, Divergence, int, int, int, int, str | None]
] = [
    (
        [U0, A0, user("Other.")],
        None,
        1,
        Divergence.HISTORY_EDITED,
        1,
        1,
        3,
        2,
        AFTER_ANSWER.format("Other."),
    ),
    (
        [U0, A0, U1, U2],
        None,
        1,
        Divergence.ANSWER_DROPPED,
        1,
        1,
        3,
        3,
        "\n<|im_start|>user\nNext.<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    ([user("Other.")], None, 2, Divergence.HISTORY_EDITED, 0, 2, 7, 0, None),
    ([U0, A0, U1, A1, U2], TOOLS, 2, Divergence.TOOLS_CHANGED, 0, 2, 7, 0, None),
]


@pytest.mark.parametrize(
    ("messages", "tools", "max_turns", "reason", "keep", "dropped", "tokens", "message", "delta"),
    ROLLBACKS,
    ids=["history-edited", "answer-dropped", "two-turns", "tools-changed"],
)
def test_rollback_within_max_rollback_turns(
    tok: ChatTokenizer,
    messages: list[Message],
    tools: list[Any] | None,
    max_turns: int,
    reason: Divergence,
    keep: int,
    dropped: int,
    tokens: int,
    message: int,
    delta: str | None,
) -> None:
    assert (len(sampled_ids(tok, A0)), len(sampled_ids(tok, A1))) == (4, 3)
    session = two_turns(tok)
    kept = stored_ids(session)[: session.trajectory.turns[0].completion_end]
    req = request(messages, tools=tools)
    pol = policy(on_divergence=OnDivergence.ROLLBACK, max_rollback_turns=max_turns)
    plan = plan_turn(session, req, tok, pol)
    assert plan.branch is None
    assert plan.rollback == Rollback(reason, 0, keep, dropped, tokens, message)
    if delta is None:
        assert_from_scratch(plan, tok, req)
    else:
        assert plan.keep_turns == keep == 1
        assert plan.prompt_ids == tok.encode(delta)
        assert plan.input_ids.tolist() == kept + plan.prompt_ids
        assert plan.experts_start == len(kept) - 1
    commit(session, plan, sampled_ids(tok, A1), A1, now=3.0)
    assert session.earlier == []
    assert [r.reason for r in session.rollbacks] == [reason]
    assert len(session.trajectory.turns) == keep + 1


@pytest.mark.parametrize(
    ("messages", "tools", "max_turns", "match"),
    [
        ([user("Other.")], None, 1, r"at message 0; that would roll back 2 turns \(max 1\)"),
        ([U0, A0, U1, A1, U2], TOOLS, 1, r"at message 0; that would roll back 2 turns"),
        (
            [U0, A0, user("Other.")],
            None,
            0,
            r"at message 2; that would roll back 1 turns \(max 0\)",
        ),
        # The kept turn (turn 0) is followed by an assistant message.
        ([U0, A0, U1, assistant("Edited."), U2], None, 1, "at message 3 and do not continue"),
        # Nothing follows the kept turn.
        ([U0, A0], None, 1, "at message 2 and do not continue"),
        # A role outside append_roles follows the kept turn.
        ([U0, A0, {"role": "system", "content": "Hi."}], None, 1, "at message 2 and do not"),
    ],
    ids=[
        "beyond-max",
        "tools-changed-beyond-max",
        "max-zero",
        "answer-edited",
        "nothing-after-kept-turn",
        "role-after-kept-turn",
    ],
)
def test_rollback_refused(
    tok: ChatTokenizer,
    messages: list[Message],
    tools: list[Any] | None,
    max_turns: int,
    match: str,
) -> None:
    session = two_turns(tok)
    pol = policy(on_divergence=OnDivergence.ROLLBACK, max_rollback_turns=max_turns)
    with pytest.raises(TrajectoryDiverged, match=match) as raised:
        plan_turn(session, request(messages, tools=tools), tok, pol)
    assert raised.value.param == "messages"


@pytest.mark.parametrize(
    ("messages", "tools", "reason", "message"),
    [
        ([user("Other.")], None, Divergence.HISTORY_EDITED, 0),
        ([U0, A0, U1], TOOLS, Divergence.TOOLS_CHANGED, 0),
    ],
    ids=["history-edited", "tools-changed"],
)
def test_one_turn_session_accepts_any_request_under_rollback(
    tok: ChatTokenizer,
    messages: list[Message],
    tools: list[Any] | None,
    reason: Divergence,
    message: int,
) -> None:
    session = one_turn(tok)
    req = request(messages, tools=tools)
    pol = policy(on_divergence=OnDivergence.ROLLBACK, max_rollback_turns=0)
    plan = plan_turn(session, req, tok, pol)
    assert_from_scratch(plan, tok, req)
    assert plan.branch is None
    assert plan.rollback == Rollback(reason, 0, 0, 1, 4, message)


# --- appended roles -----------------------------------------------------------

SYSTEM: Message = {"role": "system", "content": "Reminder."}
TOOL: Message = {"role": "tool", "tool_call_id": "c1", "content": "out"}


@pytest.mark.parametrize(
    ("appended", "index", "role"),
    [
        ([SYSTEM], 2, "system"),
        ([TOOL, SYSTEM, U1], 3, "system"),
        ([assistant("I made this up."), U1], 2, "assistant"),
    ],
    ids=["system", "tool-system-user", "assistant"],
)
@pytest.mark.parametrize("on_divergence", ALL_POLICIES, ids=POLICY_IDS)
def test_appended_role_outside_append_roles(
    tok: ChatTokenizer,
    appended: list[Message],
    index: int,
    role: str,
    on_divergence: OnDivergence,
) -> None:
    session = one_turn(tok)
    req = request([U0, A0, *appended])
    pol = policy(on_divergence=on_divergence)
    if on_divergence is OnDivergence.SEGMENT:
        plan = plan_turn(session, req, tok, pol)
        assert_from_scratch(plan, tok, req)
        assert plan.branch == Branch(Divergence.APPENDED_ROLE, segment=0, message=index)
        assert plan.rollback is None
        return
    # Not trajectory_diverged: 400 invalid_request naming the message's role.
    with pytest.raises(InvalidRequest, match=f"messages\\[{index}\\] has role '{role}'") as raised:
        plan_turn(session, req, tok, pol)
    assert raised.type is InvalidRequest
    assert raised.value.param == f"messages[{index}].role"


def test_appended_role_in_append_roles_extends(tok: ChatTokenizer) -> None:
    session = one_turn(tok)
    stored = stored_ids(session)
    pol = policy(append_roles=frozenset({"tool", "user", "system"}))
    plan = plan_turn(session, request([U0, A0, SYSTEM]), tok, pol)
    assert plan.keep_turns == 1 and plan.branch is None and plan.rollback is None
    assert plan.prompt_ids == tok.encode(
        "\n<|im_start|>system\nReminder.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert plan.input_ids.tolist() == stored + plan.prompt_ids


def test_appended_role_the_template_drops_cannot_extend(tok: ChatTokenizer) -> None:
    # ChatML renders no `developer` message: appending one cannot be token-in/token-out.
    session = one_turn(tok)
    pol = policy(append_roles=frozenset({"tool", "user", "developer"}))
    req = request([U0, A0, {"role": "developer", "content": "Reminder."}])
    with pytest.raises(TemplateCannotExtend, match="appended message 0 \\(role 'developer'\\)"):
        plan_turn(session, req, tok, pol)


# --- --prompt-mode render vs tito ---------------------------------------------


def test_render_equals_tito_when_the_render_reproduces_the_ids(tok: ChatTokenizer) -> None:
    session = two_turns(tok)
    req = request([U0, A0, U1, A1, U2])
    tito = plan_turn(session, req, tok, POLICY)
    render = plan_turn(session, req, tok, policy(prompt_mode=PromptMode.RENDER))
    assert render.keep_turns == tito.keep_turns == 2
    assert render.branch is None and render.rollback is None
    assert render.prompt_ids == tito.prompt_ids == tok.encode(AFTER_ANSWER.format("More."))
    assert render.input_ids.tolist() == tito.input_ids.tolist()
    assert render.input_ids.tolist() == tok.first_turn(req.messages, tools=None, kwargs={})
    assert render.experts_start == tito.experts_start == len(stored_ids(session)) - 1


@pytest.mark.parametrize(("odd_turn", "message"), [(0, 1), (1, 3)], ids=["turn-0", "turn-1"])
def test_render_starts_a_segment_where_it_does_not_reproduce_the_ids(
    tok: ChatTokenizer, odd_turn: int, message: int
) -> None:
    if odd_turn == 0:
        session = two_turns(tok, ids0=odd_ids(tok, A0))
    else:
        session = two_turns(tok, ids1=odd_ids(tok, A1))
    stored = stored_ids(session)
    req = request([U0, A0, U1, A1, U2])
    # tito: the stored ids, as sampled, then the new message.
    tito = plan_turn(session, req, tok, POLICY)
    assert tito.keep_turns == 2 and tito.branch is None
    assert tito.input_ids.tolist() == stored + tok.encode(AFTER_ANSWER.format("More."))
    # render: the template's own ids, in a new segment.
    render = plan_turn(session, req, tok, policy(prompt_mode=PromptMode.RENDER))
    assert_from_scratch(render, tok, req)
    assert render.branch == Branch(Divergence.RENDERED_DIFFERENTLY, segment=0, message=message)
    assert render.rollback is None


# ChatML whose first message is upper-cased once the conversation has more
# than two messages: a template that rewrites history in a prompt, not in an answer.
REWRITING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set text = message.content or '' %}"
    "{%- if loop.first and messages | length > 2 %}{%- set text = text | upper %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + text + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_render_names_the_message_holding_the_first_unreproduced_token(tmp_path: Path) -> None:
    """docs/api.md#history-rules: a render that does not start with the
    segment's ids starts a segment "at the message holding the first token the
    render does not reproduce". Here that token is in the first user message
    ("START." for "Start."), inside turn 0's prompt, not in its answer."""
    template = tmp_path / "rewriting.jinja"
    template.write_text(REWRITING_TEMPLATE, encoding="utf-8")
    rewriting = load_tokenizer(bundled_tokenizer_path(), str(template))
    session = one_turn(rewriting)
    req = request([U0, A0, U1])
    rendered = rewriting.render(req.messages, tools=None, kwargs={}, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>user\nSTART.<|im_end|>\n")
    # tito keeps what the model saw.
    tito = plan_turn(session, req, rewriting, POLICY)
    assert tito.keep_turns == 1 and tito.branch is None
    plan = plan_turn(session, req, rewriting, policy(prompt_mode=PromptMode.RENDER))
    assert_from_scratch(plan, rewriting, req)
    assert plan.branch == Branch(Divergence.RENDERED_DIFFERENTLY, segment=0, message=0)


@pytest.mark.parametrize(
    "on_divergence", [OnDivergence.ROLLBACK, OnDivergence.ERROR], ids=["rollback", "error"]
)
def test_render_that_does_not_reproduce_the_ids_is_refused(
    tok: ChatTokenizer, on_divergence: OnDivergence
) -> None:
    session = one_turn(tok, odd_ids(tok, A0))
    pol = policy(prompt_mode=PromptMode.RENDER, on_divergence=on_divergence)
    with pytest.raises(TrajectoryDiverged, match="in message 1") as raised:
        plan_turn(session, request([U0, A0, U1]), tok, pol)
    assert f"--on-divergence {on_divergence.value}" in raised.value.message
    assert raised.value.param == "messages"


# --- a template rendered whole (its appended messages depend on the history) ---

HISTORY_TEMPLATES = FIXTURES / "history-templates"
WHOLE = policy(rendered_whole=frozenset({None}))  # as the start-up check serves one


def fixture_template(name: str) -> ChatTokenizer:
    """A ChatML template of tests/fixtures/history-templates."""
    return load_tokenizer(bundled_tokenizer_path(), str(HISTORY_TEMPLATES / f"{name}.jinja"))


def test_a_template_rendered_whole_sends_its_render() -> None:
    """The third user message is "#3" after the real history, "#2" after the
    junction's synthetic context: rendered whole, the prompt is the render,
    which starts with the session's ids, so the segment goes on. Served
    token-in/token-out, the turn would send a prompt no render holds."""
    tok = fixture_template("counts-users")
    session = two_turns(tok)
    stored = stored_ids(session)
    req = request([U0, A0, U1, A1, U2])
    plan = plan_turn(session, req, tok, WHOLE)
    full = tok.first_turn(req.messages, tools=None, kwargs={})
    assert plan.input_ids.tolist() == full and full[: len(stored)] == stored
    assert plan.prompt_ids == full[len(stored) :]
    assert (plan.keep_turns, plan.branch, plan.rollback) == (2, None, None)
    assert "#3 More." in tok.decode(plan.prompt_ids)
    assert "#2 More." in tok.decode(plan_turn(session, req, tok, POLICY).prompt_ids)


def test_a_template_rendered_whole_keeps_ids_it_rewrites_while_it_appends_alike() -> None:
    """The render upper-cases the first message, which the session holds as
    the model saw it. Turn 2's appended message is "#2" after the real
    history as after the synthetic context: the session keeps its ids and
    appends the junction's, as token-in/token-out does. Turn 3's is not
    ("#3" for "#2"), and the render does not start with the session's ids: a
    new segment, rendered from scratch."""
    tok = fixture_template("counts-users-upper-first")
    session = one_turn(tok)
    req = request([U0, A0, U1])
    plan = plan_turn(session, req, tok, WHOLE)
    assert (plan.keep_turns, plan.branch) == (1, None)
    assert plan.input_ids.tolist() == stored_ids(session) + plan.prompt_ids
    assert plan.prompt_ids == plan_turn(session, req, tok, POLICY).prompt_ids
    full = tok.first_turn(req.messages, tools=None, kwargs={})
    assert full[: len(stored_ids(session))] != stored_ids(session)
    commit(session, plan, sampled_ids(tok, A1), A1, now=2.0)
    req = request([U0, A0, U1, A1, U2])
    plan = plan_turn(session, req, tok, WHOLE)
    assert_from_scratch(plan, tok, req)
    assert plan.branch == Branch(Divergence.RENDERED_DIFFERENTLY, segment=0, message=0)


def test_a_block_moved_in_front_of_the_appended_messages_is_not_the_junctions() -> None:
    """The template writes the system message right before the last user
    message. The render of [S, U0, A0, U1] ends with exactly the ids the
    junction appends after the sampled <|im_end|> (the moved block ends with
    one too), but the system block before them is the appended messages'
    too: the turn renders whole, and as the render does not start with the
    session's ids, starts a new segment rather than drop the block."""
    tok = fixture_template("moves-system")
    system: Message = {"role": "system", "content": "Be brief."}
    session = new_session()
    first = request([system, U0])
    commit(session, plan_turn(session, first, tok, WHOLE), sampled_ids(tok, A0), A0)
    req = request([system, U0, A0, U1])
    tito = plan_turn(session, req, tok, POLICY)
    full = tok.first_turn(req.messages, tools=None, kwargs={})
    assert full[len(full) - len(tito.prompt_ids) - 1 :] == [IM_END, *tito.prompt_ids]
    assert "Be brief." not in tok.decode(tito.prompt_ids)
    plan = plan_turn(session, req, tok, WHOLE)
    assert_from_scratch(plan, tok, req)
    assert plan.branch == Branch(Divergence.RENDERED_DIFFERENTLY, segment=0, message=0)


@pytest.mark.parametrize(
    "on_divergence", [OnDivergence.ROLLBACK, OnDivergence.ERROR], ids=["rollback", "error"]
)
def test_a_template_rendered_whole_refuses_what_it_cannot_continue(
    on_divergence: OnDivergence,
) -> None:
    tok = fixture_template("counts-users-upper-first")
    session = two_turns(tok)
    with pytest.raises(TrajectoryDiverged, match="in message 0") as raised:
        plan_turn(
            session,
            request([U0, A0, U1, A1, U2]),
            tok,
            replace(WHOLE, on_divergence=on_divergence),
        )
    assert "so the turn is rendered whole" in raised.value.message
    assert f"--on-divergence {on_divergence.value}" in raised.value.message


def test_only_the_templates_named_are_rendered_whole() -> None:
    """A policy naming another template (`tool_use`) serves this one, the
    only one (named None), token-in/token-out."""
    tok = fixture_template("counts-users")
    session = two_turns(tok)
    req = request([U0, A0, U1, A1, U2])
    named = policy(rendered_whole=frozenset({"tool_use"}))
    assert "#2 More." in tok.decode(plan_turn(session, req, tok, named).prompt_ids)


def test_prompt_mode_render_keeps_its_rule_for_a_template_rendered_whole() -> None:
    """--prompt-mode render extends only a render that starts with the
    session's ids, whatever the template: turn 2 starts a segment."""
    tok = fixture_template("counts-users-upper-first")
    session = one_turn(tok)
    req = request([U0, A0, U1])
    plan = plan_turn(session, req, tok, replace(WHOLE, prompt_mode=PromptMode.RENDER))
    assert_from_scratch(plan, tok, req)
    assert plan.branch == Branch(Divergence.RENDERED_DIFFERENTLY, segment=0, message=0)


# --- --max-segments -----------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "mode", "reason"),
    [
        ([user("Other.")], PromptMode.TITO, Divergence.HISTORY_EDITED),
        ([U0, A0, SYSTEM], PromptMode.TITO, Divergence.APPENDED_ROLE),
        ([U0, A0, U1], PromptMode.RENDER, Divergence.RENDERED_DIFFERENTLY),
    ],
    ids=["history-edited", "appended-role", "rendered-differently"],
)
def test_no_segment_past_max_segments(
    tok: ChatTokenizer, messages: list[Message], mode: PromptMode, reason: Divergence
) -> None:
    session = one_turn(tok, odd_ids(tok, A0))
    pol = policy(max_segments=1, prompt_mode=mode)
    with pytest.raises(TooManySegments, match=f"\\({reason.value}\\)") as raised:
        plan_turn(session, request(messages), tok, pol)
    assert "--max-segments (1)" in raised.value.message
    assert raised.value.code == "too_many_segments"
    assert raised.value.param == "messages"


def test_max_segments_leaves_extensions_and_retries(tok: ChatTokenizer) -> None:
    pol = policy(max_segments=2)
    session = one_turn(tok)
    compacted = request([user("Other.")])
    plan = plan_turn(session, compacted, tok, pol)
    assert plan.branch == Branch(Divergence.HISTORY_EDITED, segment=0, message=0)
    commit(session, plan, sampled_ids(tok, A1), A1, now=2.0)
    assert len(session.segments()) == 2
    stored = stored_ids(session)
    # Extension of the second segment.
    extension = plan_turn(session, request([user("Other."), A1, U2]), tok, pol)
    assert extension.keep_turns == 1 and extension.branch is None
    assert extension.input_ids.tolist() == stored + tok.encode(AFTER_ANSWER.format("More."))
    # A retry of its first request: a rollback in segment 1.
    retry = plan_turn(session, compacted, tok, pol)
    assert retry.rollback == Rollback(Divergence.RETRY, 1, 0, 1, 3, 1)
    assert retry.branch is None
    # A third segment is one too many.
    with pytest.raises(TooManySegments, match=r"--max-segments \(2\) segments already"):
        plan_turn(session, request([U0]), tok, pol)
