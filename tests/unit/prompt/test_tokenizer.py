"""Token-in/token-out prompt building: junctions against full renders."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from rollout_session.emulator.tokenizer import bundled_tokenizer_path
from rollout_session.errors import InvalidRequest, InvariantViolated, TemplateCannotExtend
from rollout_session.prompt.junction import continuation
from rollout_session.prompt.model_output import answer_ids
from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer
from tests import FIXTURES
from tests.conftest import TOOLS
from tests.families import FAMILIES, family_tokenizer, model_tokenizer

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


HISTORY_TEMPLATES = FIXTURES / "history-templates"

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


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", [0, 100, 200_000], ids=["empty", "short", "long"])
def test_encode_gives_the_tokenizers_own_ids(family: str, size: int) -> None:
    """`encode` takes the tokenizer's fast path (no offsets, the GIL
    released): the ids of its plain `encode`, special tokens and all."""
    tok = family_tokenizer(family)
    line = "def f(x):\n    return x * 2  # ünïcode 日本 😀 <|im_end|> </s> [INST]\n"
    text = (line * (size // len(line) + 1))[:size]
    expected = tok._backend.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == expected


# --- Named templates, tools-only templates, calls history renders otherwise ---

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "read a.py"},
]


@pytest.mark.parametrize(
    ("tools", "name"), [(None, "default"), (TOOLS, "tool_use")], ids=["no-tools", "tools"]
)
def test_named_templates_are_chosen_per_request_as_transformers_does(
    tools: list[Any] | None, name: str
) -> None:
    """Hermes 3 ships `default` and `tool_use` (transformers' list form): a
    request with tools renders with `tool_use`, any other with `default`,
    exactly what transformers' own `apply_chat_template` renders."""
    tok = model_tokenizer("hermes-3")
    assert [t.name for t in tok.templates] == ["default", "tool_use"]
    assert tok.template_for(tools).name == name
    ours = tok.render(CONVERSATION, tools=tools, kwargs={}, add_generation_prompt=True)
    theirs = tok._tok.apply_chat_template(
        CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ("<tools>" in ours) is (tools is not None)


def test_a_tools_only_template_refuses_a_request_without_tools() -> None:
    """Hermes' `tool_use` iterates `tools` unguarded (TypeError on None):
    served alone (`--chat-template tool_use`), a request without tools is
    the request's fault (400), not a template failure (500)."""
    tok = model_tokenizer("hermes-3", "tool_use")
    [template] = tok.templates
    assert (template.name, template.needs_tools) == ("tool_use", True)
    with pytest.raises(InvalidRequest, match="renders only with tools") as raised:
        tok.first_turn(CONVERSATION, tools=None, kwargs={})
    assert not isinstance(raised.value, InvariantViolated) and raised.value.param == "tools"
    assert tok.first_turn(CONVERSATION, tools=TOOLS, kwargs={})


# What `appends_alike` is asked about: ANSWER's tool round, a second one,
# and a third user message after a text answer.
CALL2 = {
    "id": "f5g6h7i8j",
    "type": "function",
    "function": {"name": "read_file", "arguments": {"path": "b.py"}},
}
ROUNDS: dict[str, tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]] = {
    "first-tool-round": (HISTORY, ANSWER, APPENDS["tool"]),
    "second-tool-round": (
        [*HISTORY, ANSWER, *APPENDS["tool"]],
        {"role": "assistant", "content": "", "tool_calls": [CALL2]},
        [{"role": "tool", "tool_call_id": "f5g6h7i8j", "content": "y = 2"}],
    ),
    "user-after-text": (
        [
            *HISTORY,
            ANSWER,
            *APPENDS["tool"],
            {"role": "assistant", "content": "It sets x."},
            {"role": "user", "content": "And then?"},
        ],
        {"role": "assistant", "content": "Nothing."},
        [{"role": "user", "content": "Thanks."}],
    ),
}


def _fixture_template(name: str) -> ChatTokenizer:
    return load_tokenizer(bundled_tokenizer_path(), str(HISTORY_TEMPLATES / f"{name}.jinja"))


@pytest.mark.parametrize(
    ("tokenizer", "rounds", "alike"),
    [
        # The synthetic context renders these as the real history does.
        (lambda: family_tokenizer("qwen2.5"), list(ROUNDS), True),
        # Calls without their content rendered (the generation-prompt split).
        (lambda: family_tokenizer("llama-3.1"), ["first-tool-round", "second-tool-round"], True),
        # Tool results name their call by its number across the conversation.
        (lambda: model_tokenizer("command-r7b"), ["first-tool-round", "user-after-text"], True),
        (lambda: model_tokenizer("command-r7b"), ["second-tool-round"], False),
        # The system prompt and the tools go into the last user message.
        (lambda: family_tokenizer("mistral-nemo"), ["first-tool-round", "second-tool-round"], True),
        (lambda: family_tokenizer("mistral-nemo"), ["user-after-text"], False),
        # A system block moved in front of the appended user message.
        (lambda: _fixture_template("moves-system"), ["user-after-text"], False),
        (lambda: _fixture_template("counts-users"), ["first-tool-round"], True),
        (lambda: _fixture_template("counts-users"), ["user-after-text"], False),
    ],
    ids=[
        "qwen2.5", "llama-3.1", "command-r7b-first-round", "command-r7b-second-round",
        "mistral-nemo-tool-rounds", "mistral-nemo-user", "moves-system", "counts-first-user",
        "counts-second-user",
    ],
)  # fmt: skip
def test_appends_alike_after_the_real_history(
    tokenizer: Callable[[], ChatTokenizer], rounds: list[str], alike: bool
) -> None:
    """Whether the template writes after the last answer, with the real
    history before it, what the junction's synthetic context has: where it
    does, the junction's ids are the template's own after this history."""
    tok = tokenizer()
    for name in rounds:
        history, previous, new = ROUNDS[name]
        assert tok.appends_alike(history, previous, new, tools=TOOLS, kwargs={}) is alike, name


def test_several_templates_without_a_default_name_the_fix(hf_tokenizer: Any) -> None:
    hf = copy.copy(hf_tokenizer)
    hf.chat_template = {"tool_use": "{{ messages }}", "rag": "{{ documents }}"}
    with pytest.raises(ValueError, match=r"\(rag, tool_use\).*--chat-template NAME"):
        ChatTokenizer(hf)


@pytest.mark.parametrize("name", list(APPENDS))
def test_a_template_ending_every_last_turn_with_a_generation_prompt_is_served(
    name: str,
) -> None:
    """Command-R7B writes `<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>
    <|CHATBOT_TOKEN|>` after any last turn, its tool calls' too: that ending
    is no part of the calls (it was refused as "renders the previous answer's
    tool calls differently when messages follow"); the junction is exact."""
    tok = model_tokenizer("command-r7b")
    server, full = _extended(tok, APPENDS[name])
    assert server == full


# History writes each call's id, the last turn does not (the model sampled
# that): the calls render differently once messages follow. Synthetic: no
# genuine template found does only this (see docs/templates.md).
_IDS_IN_HISTORY = (
    "{%- for m in messages %}{%- set last = loop.last %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ '{' }}"
    '{%- if not last %}"id": "{{ c.id }}", {% endif %}'
    '"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_calls_history_renders_otherwise_keep_the_sampled_ids_and_a_stable_tail(
    hf_tokenizer: Any,
) -> None:
    """Only the tail after the calls is appended: it is what stays the same
    when the calls' argument values change, after the closing the last turn
    writes too. The sampled calls stay as sampled."""
    tok = ChatTokenizer(hf_tokenizer, _IDS_IN_HISTORY)
    server, full = _extended(tok, APPENDS["tool-then-user"])
    text = "".join(tok.decode_pieces(server))
    assert text.count('"id"') == 0 and "".join(tok.decode_pieces(full)).count('"id"') == 1
    # Everything from the sampled calls' closing on is the template's own.
    tail = text[text.index("</tool_call>") :]
    full_text = "".join(tok.decode_pieces(full))
    assert full_text.endswith(tail)


def test_a_tail_that_cannot_be_told_from_the_calls_is_refused(hf_tokenizer: Any) -> None:
    """Calls without arguments: nothing to vary, so no tail can be located."""
    tok = ChatTokenizer(hf_tokenizer, _IDS_IN_HISTORY)
    call = {**CALL, "function": {"name": "read_file", "arguments": {}}}
    previous = {"role": "assistant", "content": "", "tool_calls": [call]}
    with pytest.raises(InvariantViolated, match="cannot be told apart"):
        tok.junction(previous, APPENDS["tool"], tools=TOOLS, kwargs={})
