"""How messages reach a chat template (as SGLang and vLLM hand them over)."""

from __future__ import annotations

import pytest

from rollout_session.prompt.messages import Message
from rollout_session.prompt.template_input import ArgumentStyle, template_message
from tests.families import family_tokenizer

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        (
            {"role": "assistant", "content": "hi", "tool_calls": [], "reasoning_content": None},
            {"role": "assistant", "content": "hi"},
        ),
        (
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
        ),
        (
            {"role": "tool", "content": "x", "tool_call_id": None, "name": None},
            {"role": "tool", "content": "x"},
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": None}]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": CALL["function"]}],
            },
        ),
    ],
    ids=["empty-tool-calls-dropped", "none-content-empty", "none-keys-dropped", "none-call-id"],
)
def test_template_message(stored: Message, expected: Message) -> None:
    assert template_message(stored, ArgumentStyle.DICT) == expected


def test_string_style_serialises_arguments_like_sglang_parsers() -> None:
    message = {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": {"city": "Zürich"}}}
    ]}  # fmt: skip
    out = template_message(message, ArgumentStyle.STRING)
    assert out["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'
    # A string the agent sent (not JSON) is left as it is.
    raw = {**CALL, "function": {"name": "f", "arguments": "not json"}}
    out = template_message({**message, "tool_calls": [raw]}, ArgumentStyle.STRING)
    assert out["tool_calls"][0]["function"]["arguments"] == "not json"


@pytest.mark.parametrize(
    ("family", "style"),
    [
        ("qwen3", ArgumentStyle.DICT),
        ("glm-4.6", ArgumentStyle.DICT),
        ("gpt-oss", ArgumentStyle.DICT),
        ("llama-3.1", ArgumentStyle.DICT),
        # DeepSeek's templates concatenate `arguments` into the prompt.
        ("deepseek-v3.1", ArgumentStyle.STRING),
    ],
)
def test_argument_style_is_probed_from_the_template(family: str, style: ArgumentStyle) -> None:
    assert family_tokenizer(family).arguments is style
