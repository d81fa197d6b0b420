"""A turn's limits: the room a prompt may fill, refused within it on every
family's template, the completion budget that makes the session cap hard,
and the bytes of text a planned turn leaves its session keeping."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rollout_session.emulator import bundled_tokenizer_path
from rollout_session.errors import ContextLengthExceeded, SessionTooLarge
from rollout_session.prompt import bounded
from rollout_session.prompt.bounded import PromptTooLong
from rollout_session.prompt.messages import assistant_message
from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer
from rollout_session.session.conversation import encode, record_bytes
from rollout_session.turn.limits import PromptRoom, completion_budget, keep_bytes, prompt_room
from rollout_session.turn.plan import plan_turn
from tests.families import FAMILIES, family_tokenizer
from tests.unit.turn.test_plan import (
    A0,
    A1,
    POLICY,
    U0,
    U1,
    U2,
    commit,
    one_turn,
    request,
    sampled_ids,
    user,
)

CALL = {
    "id": "a1b2c3d4e",  # Mistral's templates want 9 alphanumerics
    "type": "function",
    "function": {"name": "read_file", "arguments": {"path": "a.py"}},
}


def long_text(words: int) -> str:
    rng = random.Random(words)
    vocabulary = ("lorem", "ipsum", "x=1;", "日本語", "  ", "\n", "(a, b)", "über")
    return " ".join(rng.choice(vocabulary) for _ in range(words))


@pytest.mark.parametrize(
    ("max_tokens", "context", "cap", "room"),
    [
        (None, None, None, None),
        (None, 1000, None, PromptRoom(999, 1000, "the model's context", 1)),
        (50, 1000, 800, PromptRoom(750, 800, "the session token cap (--max-session-tokens)", 50)),
        (5000, 1000, None, PromptRoom(0, 1000, "the model's context", 5000)),
    ],
    ids=["no-limit", "context", "cap-smaller", "max-tokens-over"],
)
def test_prompt_room(
    max_tokens: int | None, context: int | None, cap: int | None, room: PromptRoom | None
) -> None:
    assert prompt_room(max_tokens, context_length=context, session_cap=cap) == room


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_is_refused_only_past_its_room(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First turns and appended messages, each several pieces long: the
    exact ids within the room, `PromptTooLong` well past it."""
    monkeypatch.setattr(bounded, "PIECE_CHARS", 1024)
    tok = family_tokenizer(family)
    text = long_text(3_000)
    first: list[dict[str, Any]] = [{"role": "user", "content": text}]
    ids = tok.first_turn(first, tools=None, kwargs={})
    assert tok.first_turn(first, tools=None, kwargs={}, most=len(ids)) == ids
    with pytest.raises(PromptTooLong) as refused:
        tok.first_turn(first, tools=None, kwargs={}, most=len(ids) // 2)
    assert len(ids) // 2 < refused.value.at_least <= len(ids)
    previous = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    appended = [{"role": "tool", "tool_call_id": CALL["id"], "content": text}]
    junction = tok.junction(previous, appended, tools=None, kwargs={})
    within = tok.junction(previous, appended, tools=None, kwargs={}, most=len(junction.ids))
    assert within == junction
    with pytest.raises(PromptTooLong):
        tok.junction(previous, appended, tools=None, kwargs={}, most=len(junction.ids) // 2)


def test_the_refusal_names_the_limit() -> None:
    room = prompt_room(100, context_length=4096, session_cap=None)
    assert room is not None
    refusal = room.refused(5000)
    assert isinstance(refusal, ContextLengthExceeded)
    assert refusal.message == (
        "the prompt holds at least 5000 tokens; with max_tokens 100 that exceeds the "
        "model's context of 4096 tokens"
    )


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "context", "cap", "expected"),
    [
        (100, None, 4096, None, None),  # the worker fills to its context
        (100, 50, 4096, None, None),  # the agent's own max_tokens
        (100, None, 4096, 500, 400),  # the cap's remainder
        (100, None, None, 101, 1),
        (100, None, 1000, 4096, 900),  # a cap above the context: the context's room
        (100, 400, 4096, 500, None),
        (100, 401, 4096, 500, ContextLengthExceeded),
        (500, None, 4096, 500, ContextLengthExceeded),
        (4096, None, 4096, None, ContextLengthExceeded),
        (4000, 97, 4096, None, ContextLengthExceeded),
    ],
    ids=[
        "no-limit-set",
        "agent-max",
        "cap-remainder",
        "cap-one-left",
        "cap-over-context",
        "agent-max-at-cap",
        "agent-max-over-cap",
        "cap-full",
        "context-full",
        "over-context",
    ],
)
def test_completion_budget(
    prompt: int,
    max_tokens: int | None,
    context: int | None,
    cap: int | None,
    expected: int | type[Exception] | None,
) -> None:
    def budget() -> int | None:
        return completion_budget(prompt, max_tokens, context_length=context, session_cap=cap)

    if isinstance(expected, type):
        with pytest.raises(expected):
            budget()
    else:
        assert budget() == expected


# -- what a session keeps ---------------------------------------------------------


REASONING = {"role": "assistant", "content": "Ok.", "reasoning_content": "x" * 50_000}
PLANS: dict[str, list[dict[str, Any]]] = {
    "extension": [U0, A0, U1, REASONING, U2],
    "new-segment": [user("Something else."), REASONING, U2],
    "retry": [U0],
}


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return load_tokenizer(bundled_tokenizer_path(), "chatml")


@pytest.mark.parametrize("messages", PLANS.values(), ids=PLANS.keys())
def test_keep_bytes_is_what_the_commit_leaves_kept_but_the_answer(
    tok: ChatTokenizer, messages: list[dict[str, Any]]
) -> None:
    """Measured on the plan (its new messages encoded once, for the commit):
    the session keeps exactly that, plus its answer, once the turn commits;
    one byte less of budget refuses it, the session untouched."""
    session = one_turn(tok)
    plan = plan_turn(session, request(messages), tok, POLICY)
    before = session.stored_bytes()
    with pytest.raises(SessionTooLarge, match="--max-session-mb") as refused:
        keep_bytes(session, plan, keep_bytes(session, plan, None) - 1)
    assert refused.value.param == "messages"
    assert session.stored_bytes() == before
    total = keep_bytes(session, plan, None)
    assert plan.encoded is not None
    commit(session, plan, sampled_ids(tok, A1), A1)
    answer = record_bytes(encode([assistant_message("Done.", [], None)]))
    assert session.stored_bytes() == total + answer
    if messages is PLANS["new-segment"]:
        assert len(session.earlier) == 1 and total > before + 50_000
