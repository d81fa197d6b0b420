"""A turn's token limits: the render-free prompt floor is a true lower bound,
and the completion budget makes the session cap hard."""

from __future__ import annotations

import functools
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_session.errors import ContextLengthExceeded
from rollout_session.prompt.tokenizer import ChatTokenizer
from rollout_session.turn.limits import check_prompt_floor, completion_budget, prompt_floor
from tests.families import FAMILIES, family_tokenizer


@functools.cache
def worst_text() -> str:
    """The bundled vocabulary's longest tokens, decoded and repeated: the text
    that packs the most bytes into each token, the bound's worst case (framed,
    so that strip() keeps them even if they are whitespace)."""
    tok: ChatTokenizer = family_tokenizer("qwen3")  # the families share the vocabulary
    pieces = tok.decode_pieces(range(tok.vocab_size))
    longest = sorted((p for p in pieces if "\ufffd" not in p), key=len)[-8:]
    return "x" + "".join(longest) * 200 + "x"


CALL = {
    "id": "a1b2c3d4e",  # Mistral's templates want 9 alphanumerics
    "type": "function",
    "function": {"name": "read_file", "arguments": {"path": "a.py"}},
}


def conversation(text: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": text},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": text[: len(text) // 2]},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": f"  {text}\n\n"},
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_floor_never_exceeds_the_rendered_prompt(family: str) -> None:
    tok = family_tokenizer(family)
    worst = worst_text()
    for text in (worst, "=" * 5000, " " * 5000 + "x", "日本語のテキスト" * 300, "a" * 9000):
        messages = conversation(text)
        rendered = len(tok.first_turn(messages, tools=None, kwargs={}))
        floor = prompt_floor(messages, tok.max_token_bytes)
        assert floor <= rendered, (text[:20], floor, rendered)
        if text is worst:
            assert floor > 0


@given(st.text(min_size=1, max_size=3000))
def test_the_floor_is_a_lower_bound_on_any_text(text: str) -> None:
    tok = family_tokenizer("qwen3")
    messages = conversation(text)
    rendered = len(tok.first_turn(messages, tools=None, kwargs={}))
    assert prompt_floor(messages, tok.max_token_bytes) <= rendered


def test_the_floor_counts_only_text_every_template_keeps_whole() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s" * 10_000},  # may be moved or merged
        {"role": "assistant", "content": "a" * 10_000},  # may be cut (<think>)
        {"role": "user", "content": " " * 10_000},  # may be stripped
        {"role": "user", "content": None},
    ]
    assert prompt_floor(messages, 4) == 0
    assert prompt_floor([{"role": "tool", "content": "x" * 800}], 4) == 100


@pytest.mark.parametrize(
    ("max_tokens", "context", "cap", "refused"),
    [
        (None, 1000, None, False),
        (50, 1000, None, False),
        (50, 120, None, True),  # 100 + 50 > context
        (None, 100, None, True),  # no room for one token
        (None, None, 120, False),
        (30, None, 120, True),  # explicit max_tokens over the cap
    ],
    ids=["fits", "fits-max", "over-context", "no-room", "cap-fits", "over-cap"],
)
def test_prompt_floor_refuses_what_cannot_fit(
    max_tokens: int | None, context: int | None, cap: int | None, refused: bool
) -> None:
    # 800 bytes of user text at 4 bytes per token (x2 for normalisers): >= 100.
    messages = [{"role": "user", "content": "x" * 800}]

    def check() -> None:
        check_prompt_floor(
            messages,
            max_tokens,
            max_token_bytes=4,
            context_length=context,
            session_cap=cap,
            body_bytes=len(orjson.dumps({"messages": messages})),
        )

    if refused:
        with pytest.raises(ContextLengthExceeded, match="at least 100 tokens"):
            check()
    else:
        check()


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


def test_a_body_too_small_to_be_refused_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def measured(*args: object) -> int:
        raise AssertionError("the floor was measured")

    monkeypatch.setattr("rollout_session.turn.limits.prompt_floor", measured)
    messages = [{"role": "user", "content": "x" * 800}]
    # 1,000 bytes at 4 bytes a token (x2): at most 125 tokens, under 4,096.
    check_prompt_floor(
        messages, 100, max_token_bytes=4, context_length=4096, session_cap=None, body_bytes=1000
    )
