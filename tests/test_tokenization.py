"""Token-in/token-out prompt building against real templates."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.tokenization import ChatTokenizer, missing_turn_end

from .conftest import TOOLS

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "read it"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
        ],
    },
]
APPENDS = {
    "tool": [{"role": "tool", "content": "x = 1"}],
    "two-tools": [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}],
    "user": [{"role": "user", "content": "thanks\nbye"}],
    "tool-then-user": [{"role": "tool", "content": "t"}, {"role": "user", "content": "u"}],
}


@pytest.mark.parametrize("template", ["chatml", "qwen3"])
@pytest.mark.parametrize("name", list(APPENDS))
def test_appended_equals_full_render_suffix(
    chat_tokenizers: dict[str, ChatTokenizer], template: str, name: str
) -> None:
    """For history the template does not rewrite, prefix + appended ids equal
    the full rendering's ids: incremental rendering changes nothing."""
    tok = chat_tokenizers[template]
    new = APPENDS[name]
    prefix = tok.encode(tok.render(HISTORY, tools=TOOLS, kwargs={}, add_generation_prompt=False))
    full = tok.encode(
        tok.render([*HISTORY, *new], tools=TOOLS, kwargs={}, add_generation_prompt=True)
    )
    turn_end, delta = tok.appended(new, tools=TOOLS, kwargs={})
    # `prefix` ends with the whole turn end, as a sampled completion would not.
    assert prefix[-len(turn_end) :] == turn_end
    assert prefix + delta == full


def test_generation_prompt_kwargs_reach_the_template(
    chat_tokenizers: dict[str, ChatTokenizer],
) -> None:
    tok = chat_tokenizers["qwen3"]
    _, thinking = tok.appended([{"role": "user", "content": "q"}], tools=None, kwargs={})
    _, plain = tok.appended(
        [{"role": "user", "content": "q"}], tools=None, kwargs={"enable_thinking": False}
    )
    assert plain[: len(thinking)] == thinking
    assert "<think>" in tok.decode_pieces(plain[len(thinking) :])


@pytest.mark.parametrize(
    ("sampled", "expected"),
    [([5, 10], [11]), ([5, 6], [10, 11]), ([], [10, 11]), ([10, 11], []), ([10], [11])],
    ids=["eos-sampled", "truncated", "empty", "whole-end-sampled", "only-eos"],
)
def test_missing_turn_end(sampled: list[int], expected: list[int]) -> None:
    assert missing_turn_end(sampled, [10, 11]) == expected


def test_vocab_size_covers_added_tokens(chat_tokenizers: dict[str, ChatTokenizer]) -> None:
    tok = chat_tokenizers["chatml"]
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] < tok.vocab_size


# The end of an assistant turn depends on a template kwarg and on the tools.
_END_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% if m.role == 'assistant' %}{{ end | default('</s>') }}"
    "{% if tools %}[{{ tools | length }}]{% endif %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_turn_end_is_kept_per_tools_and_kwargs(hf_tokenizer: Any) -> None:
    """The cached end-of-turn text is the one each (tools, kwargs) renders,
    whatever was asked before; values that are not JSON are simply not kept."""
    tok = ChatTokenizer(hf_tokenizer, _END_TEMPLATE)
    new = [{"role": "user", "content": "next"}]
    cases: list[tuple[list[Any] | None, dict[str, Any], str]] = [
        (None, {}, "</s>\n"),
        (None, {"end": "<A>"}, "<A>\n"),
        (TOOLS, {"end": "<A>"}, f"<A>[{len(TOOLS)}]\n"),
        (None, {"end": "<B>"}, "<B>\n"),
        ([], {}, "</s>\n"),  # no tools, as the template sees it
        (None, {"end": "<A>", "unused": {1, 2}}, "<A>\n"),  # a set: not JSON
    ]
    for _ in range(2):
        for tools, kwargs, expected in cases:
            assert tok.turn_end(tools=tools, kwargs=kwargs)[0] == expected
            turn_end, _ = tok.appended(new, tools=tools, kwargs=kwargs)
            assert turn_end == tok.encode(expected)
