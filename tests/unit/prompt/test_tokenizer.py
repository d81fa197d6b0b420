"""Token-in/token-out prompt building: junctions against full renders."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.errors import InvalidRequest, InvariantViolated, TemplateCannotExtend
from rollout_session.prompt.junction import continuation
from rollout_session.prompt.model_output import answer_ids
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import TOOLS
from tests.families import FAMILIES, family_tokenizer

CALL = {
    "id": "a1b2c3d4e",
    "type": "function",
    "function": {"name": "read_file", "arguments": {"path": "a.py"}},
}
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "read it"},
]
ANSWER = {"role": "assistant", "content": "", "tool_calls": [CALL]}
APPENDS = {
    "tool": [{"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "x = 1"}],
    "tool-then-user": [
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "t"},
        {"role": "user", "content": "u"},
    ],
}


def _extended(tok: ChatTokenizer, new: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(server ids, full render ids) after a tool-call answer and `new`."""
    prompt = tok.first_turn(HISTORY, tools=TOOLS, kwargs={})
    sampled = answer_ids(tok, HISTORY, ANSWER, tools=TOOLS, kwargs={})
    junction = tok.junction(ANSWER, new, tools=TOOLS, kwargs={})
    delta = continuation(sampled, junction, stopped=True, special_ids=tok.special_ids)
    full = tok.first_turn([*HISTORY, ANSWER, *new], tools=TOOLS, kwargs={})
    return [*prompt, *sampled, *delta], full


# Families whose template renders this conversation's history as sampled.
EXACT = ("qwen2.5", "qwen3-coder", "llama-3.1", "llama-3.2", "deepseek-v3.1", "glm-4.6")


@pytest.mark.parametrize("family", EXACT)
@pytest.mark.parametrize("name", list(APPENDS))
def test_tool_result_junction_equals_full_render(family: str, name: str) -> None:
    """After a tool call, the appended ids continue exactly where a full render
    does: the context carries the real call (templates render results from it)."""
    server, full = _extended(family_tokenizer(family), APPENDS[name])
    assert server == full


def test_harmony_tool_result_names_the_called_function() -> None:
    """gpt-oss renders a tool result as coming from the function the previous
    answer called: the synthetic context must carry that call."""
    tok = family_tokenizer("gpt-oss")
    server, full = _extended(tok, APPENDS["tool"])
    assert server == full
    assert "<|start|>functions.read_file to=assistant" in "".join(tok.decode_pieces(server))


def test_generation_prompt_kwargs_reach_the_template(
    chat_tokenizers: dict[str, ChatTokenizer],
) -> None:
    tok = chat_tokenizers["qwen3"]
    previous = {"role": "assistant", "content": "a"}
    new = [{"role": "user", "content": "q"}]
    thinking = tok.junction(previous, new, tools=None, kwargs={}).ids
    plain = tok.junction(previous, new, tools=None, kwargs={"enable_thinking": False}).ids
    assert plain[: len(thinking)] == thinking
    assert "<think>" in tok.decode_pieces(plain[len(thinking) :])


def test_hoisted_system_message_is_refused_not_lost() -> None:
    """DeepSeek templates move every system message to the top: appended after
    the history it would vanish from where it was sent."""
    tok = family_tokenizer("deepseek-v3.1")
    with pytest.raises(TemplateCannotExtend, match="appended message 0 \\(role 'system'\\)"):
        tok.junction(
            {"role": "assistant", "content": "a"},
            [{"role": "system", "content": "Be brief."}],
            tools=None,
            kwargs={},
        )


def test_raise_exception_is_the_requests_fault_a_template_bug_is_ours(
    hf_tokenizer: Any,
) -> None:
    refusing = ChatTokenizer(hf_tokenizer, "{{ raise_exception('no such thing') }}")
    with pytest.raises(InvalidRequest, match="no such thing"):
        refusing.render([{"role": "user", "content": "x"}], tools=None, kwargs={},
                        add_generation_prompt=True)  # fmt: skip
    broken = ChatTokenizer(hf_tokenizer, "{{ messages[0].content + 1 }}")
    with pytest.raises(InvariantViolated, match="chat template failed"):
        broken.render([{"role": "user", "content": "x"}], tools=None, kwargs={},
                      add_generation_prompt=True)  # fmt: skip


# The end of an assistant turn depends on a template kwarg and on the tools.
_END_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% if m.role == 'assistant' %}{{ end | default('</s>') }}"
    "{% if tools %}[{{ tools | length }}]{% endif %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_last_turn_rendering_is_kept_per_tools_and_kwargs(hf_tokenizer: Any) -> None:
    """The cached last-turn rendering is the one each (tools, kwargs) renders,
    whatever was asked before; values that are not JSON are simply not kept."""
    tok = ChatTokenizer(hf_tokenizer, _END_TEMPLATE)
    previous = {"role": "assistant", "content": "a"}
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
            end = tok.last_terminator(previous, tools=tools, kwargs=kwargs)
            assert end == tuple(tok.encode(expected))
            junction = tok.junction(previous, new, tools=tools, kwargs=kwargs)
            assert junction.ids[: len(end)] == end and junction.terminator == len(end)


def test_every_family_tokenizer_loads() -> None:
    for family in FAMILIES:
        tok = family_tokenizer(family)
        assert tok.stop_ids and tok.stop_ids <= set(range(tok.vocab_size))


@pytest.mark.parametrize("size", [100, 16 * 1024, 200_000], ids=["short", "threshold", "long"])
def test_encode_gives_the_same_ids_on_either_side_of_the_gil_free_threshold(size: int) -> None:
    tok = family_tokenizer("qwen3")
    text = ("def f(x):\n    return x * 2  # ünïcode 日本\n" * (size // 40 + 1))[:size]
    expected = tok._backend.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == expected
