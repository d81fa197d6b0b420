"""The `vllm` translation: the ``/inference/v1/generate`` body vLLM 0.33's
chat route would build (docs/engines.md#vllm).

Expected values come from vLLM's source, cited per test
(docs/research/vllm-0.33-generate-request.md has the passages).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from rollout_session.engines.base import EngineRequest
from rollout_session.engines.vllm.parsers import VllmParsers
from rollout_session.engines.vllm.request import (
    Untranslatable,
    VllmOptions,
    generate_body,
    parser_constrains,
    read_sampling_defaults,
    render_body,
    sampling_params,
)

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
STRICT = {"type": "function", "function": {"name": "weather", "strict": True}}
PROMPT = np.arange(10, dtype=np.int32)


def _request(params: dict[str, Any], **fields: Any) -> EngineRequest:
    base: dict[str, Any] = {
        "params": {"messages": [{"role": "user", "content": "hi"}], **params},
        "input_ids": PROMPT,
        "template_kwargs": {},
        "vocab_size": 1000,
    }
    base.update(fields)
    return EngineRequest(**base)


def _sampling(
    params: dict[str, Any],
    parsers: VllmParsers | None = None,
    context: int | None = 100,
    **options: Any,
) -> dict[str, Any]:
    opts = VllmOptions(parsers or VllmParsers(), **options)
    return sampling_params(_request(params), opts, context)


def test_a_plain_request_sends_every_key_the_chat_route_sets() -> None:
    # ChatCompletionRequest.to_sampling_params with _DEFAULT_SAMPLING_PARAMS;
    # max_tokens from get_max_tokens (the room left); logprobs 0 (the sampled token's).
    assert _sampling({}) == {
        "n": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": 90,
        "min_tokens": 0,
        "stop": [],
        "stop_token_ids": [],
        "ignore_eos": False,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "include_stop_str_in_output": False,
        "logprobs": 0,
        "seed": None,
        "structured_outputs": None,
    }


@pytest.mark.parametrize(
    ("params", "defaults", "context", "cap", "expected"),
    [
        ({"max_tokens": 5}, {}, 100, None, 5),
        ({"max_completion_tokens": 7, "max_tokens": 5}, {}, 100, None, 7),
        ({"max_tokens": 95}, {}, 100, None, 90),  # clamped to the room, not refused
        ({}, {"max_new_tokens": 20}, 100, None, 20),  # the model's default
        ({"max_tokens": 30}, {"max_new_tokens": 20}, 100, None, 30),  # the request's wins
        ({}, {}, 100, 12, 12),  # the session cap
        ({}, {}, None, None, None),  # nothing known: vLLM's own room
    ],
    ids=[
        "asked",
        "completion-wins",
        "clamped",
        "model-default",
        "asked-over-default",
        "cap",
        "none",
    ],
)
def test_max_tokens_is_get_max_tokens(
    params: dict[str, Any],
    defaults: dict[str, Any],
    context: int | None,
    cap: int | None,
    expected: int | None,
) -> None:
    opts = VllmOptions(VllmParsers(), defaults)
    request = _request(params, max_tokens=cap)
    assert sampling_params(request, opts, context)["max_tokens"] == expected


def test_max_tokens_over_the_context_is_refused_with_vllms_message() -> None:
    # renderers/params.py TokenizeParams.__post_init__
    with pytest.raises(
        Untranslatable, match="max_tokens=101 cannot be greater than max_model_len=100"
    ):
        _sampling({"max_tokens": 101})


def test_model_defaults_fill_what_the_request_leaves_unset() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "skip_special_tokens": False}
    got = _sampling({"top_k": 5}, model_defaults=defaults)
    assert (got["temperature"], got["top_k"], got["skip_special_tokens"]) == (0.6, 5, False)


def test_generation_config_values_equal_to_transformers_defaults_are_not_defaults(
    tmp_path: Path,
) -> None:
    # try_get_generation_config returns GenerationConfig.to_diff_dict().
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.7, "top_k": 50, "top_p": 1.0, "max_new_tokens": 64, "eos_token_id": 2}
        )
    )
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.7, "max_new_tokens": 64}
    assert read_sampling_defaults(tmp_path / "missing") == {}


@pytest.mark.parametrize(
    ("tool_parser", "reasoning", "tools", "keeps"),
    [
        (None, None, False, False),
        ("hermes", None, False, False),
        ("hermes", None, True, True),  # Hermes2ProToolParser.adjust_request: with tools
        ("llama3_json", None, True, False),  # no hook
        ("qwen3_coder", None, False, False),  # engine-based, but adjust_request does not run
        ("qwen3_coder", None, True, True),
        ("qwen3_coder", "deepseek_r1", False, True),  # a reasoning parser makes it run
        (None, "deepseek_r1", False, False),  # base ReasoningParser: no-op
        (None, "qwen3", False, True),  # engine-based reasoning parser: every request
    ],
    ids=[
        "none",
        "hermes-no-tools",
        "hermes-tools",
        "llama3-tools",
        "coder-no-tools",
        "coder-tools",
        "coder-with-r1",
        "r1",
        "qwen3",
    ],
)
def test_skip_special_tokens_follows_the_parsers_adjust_request(
    tool_parser: str | None, reasoning: str | None, tools: bool, keeps: bool
) -> None:
    params: dict[str, Any] = {"tools": [WEATHER]} if tools else {}
    got = _sampling(params, VllmParsers(tool_parser, reasoning))
    assert got["skip_special_tokens"] is (not keeps)


@pytest.mark.parametrize(
    ("params", "parsers", "match"),
    [
        ({"tools": [WEATHER]}, VllmParsers(), '"auto" tool choice requires'),
        ({"tools": []}, VllmParsers("hermes"), "must not be an empty array"),
        ({"tool_choice": "auto"}, VllmParsers("hermes"), "`tools` must be set"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            VllmParsers("hermes"),
            "does not match any",
        ),
        ({"top_logprobs": 2, "logprobs": True}, VllmParsers(), "top_logprobs"),
        ({"n": 2}, VllmParsers(), "n must be 1"),
        ({"logit_bias": {"a": 1}}, VllmParsers(), "cannot be converted to integer"),
        ({"response_format": {"type": "json_schema"}}, VllmParsers(), "'json_schema' field must"),
    ],
    ids=[
        "tools-without-parser",
        "empty-tools",
        "choice-without-tools",
        "unknown-named",
        "top-logprobs",
        "n",
        "logit-bias-key",
        "json-schema-missing",
    ],
)
def test_what_cannot_be_reproduced_is_refused(
    params: dict[str, Any], parsers: VllmParsers, match: str
) -> None:
    with pytest.raises(Untranslatable, match=match):
        _sampling(params, parsers)


NAMED = {"type": "function", "function": {"name": "weather"}}


@pytest.mark.parametrize(
    ("params", "parser", "constrains"),
    [
        ({"tools": [WEATHER]}, "hermes", False),  # auto, level AUTO, no strict tool: no tag
        ({"tools": [WEATHER], "tool_choice": "none"}, "hermes", False),
        ({}, "glm45", False),
        ({"tools": [WEATHER], "tool_choice": "required"}, "hermes", True),
        ({"tools": [WEATHER], "tool_choice": NAMED}, "hermes", True),
        ({"tools": [STRICT]}, "hermes", True),
        ({"tools": [WEATHER], "parallel_tool_calls": False}, "hermes", True),
        ({"tools": [WEATHER]}, "glm45", True),  # default strict level FUNCTION
        ({"tools": [WEATHER], "tool_choice": "required"}, "pythonic", True),  # JSON schema
    ],
    ids=[
        "auto",
        "none",
        "no-tools",
        "required",
        "named",
        "strict",
        "not-parallel",
        "function-level",
        "json-schema-parser",
    ],
)
def test_the_constraints_only_vllm_builds_are_asked_of_its_render_route(
    params: dict[str, Any], parser: str, constrains: bool
) -> None:
    # DelegatingParser._apply_structural_tag, resolve_tool_strictness,
    # ToolParser.adjust_request.
    assert parser_constrains(params, VllmParsers(parser)) is constrains
    # The local translation still runs (every other key); the engine then
    # takes structured_outputs from /render.
    assert _sampling(params, VllmParsers(parser))["structured_outputs"] is None


def test_the_render_request_carries_what_adjust_request_reads() -> None:
    request = _request(
        {"tools": [STRICT], "tool_choice": "auto", "parallel_tool_calls": False, "seed": 3},
        template_kwargs={"enable_thinking": False},
    )
    body = orjson.loads(render_body(request, "served"))
    assert body == {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [STRICT],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 1,
        "model": "served",
    }


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"json_object": True}),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            {"json": {"type": "object"}},
        ),
    ],
    ids=["text", "json-object", "json-schema"],
)
def test_response_format_is_structured_outputs(fmt: dict[str, Any], expected: Any) -> None:
    # generate/base/protocol.py structured_outputs_from_response_format
    assert _sampling({"response_format": fmt})["structured_outputs"] == expected


def test_logit_bias_is_clamped_as_from_optional_clamps_it() -> None:
    assert _sampling({"logit_bias": {"5": 250, "7": -300.5}})["logit_bias"] == {
        "5": 100.0,
        "7": -100.0,
    }


def test_the_body_carries_the_parse_context_render_would() -> None:
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}, {"id": "2"}]},
        {"role": "tool", "content": "x", "tool_call_id": "1"},
    ]
    request = _request(
        {"messages": history, "tools": [WEATHER], "include_reasoning": False},
        template_kwargs={"enable_thinking": False},
        priority=3,
        experts_from=4,
    )
    body = orjson.loads(
        generate_body(
            request,
            VllmOptions(VllmParsers("hermes", "qwen3")),
            request_id="r1",
            model="m",
            context=100,
        )
    )
    kwargs = {
        "enable_thinking": False,
        "add_generation_prompt": True,
        "continue_final_message": False,
    }
    assert body["token_ids"] == PROMPT.tolist()
    assert body["output_mode"] == "derender"
    assert (body["model"], body["request_id"], body["priority"], body["stream"]) == (
        "m",
        "r1",
        3,
        False,
    )
    assert body["parse_context"] == {
        "tools": [WEATHER],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "include_reasoning": True,  # hidden by the reply, never by vLLM (it hides the ids)
        "chat_template_kwargs": kwargs,
        "history_tool_call_cnt": 2,
    }
    assert body["reasoning_parser_kwargs"] == {"chat_template_kwargs": kwargs}
    assert body["reasoning_ended"] is True  # resolve_reasoning_ended: include_reasoning false
    assert body["sampling_params"]["routed_experts_prompt_start"] == 4


@pytest.mark.parametrize(
    ("tool_call", "reasoning"),
    [("openai", None), (None, "openai_gptoss"), ("mistral", None), ("kimi_k3", None), (None, "x")],
    ids=["harmony-tools", "harmony-reasoning", "mistral", "kimi-k3", "unknown"],
)
def test_parsers_not_reproduced_are_refused_at_startup(
    tool_call: str | None, reasoning: str | None
) -> None:
    with pytest.raises(ValueError, match="--engine vllm does not support"):
        VllmParsers(tool_call, reasoning)
