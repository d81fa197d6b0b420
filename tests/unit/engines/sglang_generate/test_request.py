"""The `sglang-generate` translation: the ``/generate`` body SGLang 0.5.23's
chat route would build (docs/engines.md#sglang-generate).

Expected values come from SGLang's source (docs/research/sglang-0.5.23-chat-vs-generate.md;
the function is named where a value comes from it). Where the installed
SGLang can be loaded without its GPU stack, its own code is the oracle too
(`TestAgainstSGLang`): `ChatCompletionRequest.to_sampling_params`,
`get_json_schema_constraint` and the ``/generate`` contract gate.
"""

from __future__ import annotations

import ast
import json
import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from rollout_session.engines.base import EngineRequest
from rollout_session.engines.sglang_generate.parsers import (
    LEGACY_TAGS,
    REASONING_PARSERS,
    TOOL_CALL_MARKERS,
    Parsers,
)
from rollout_session.engines.sglang_generate.request import (
    MODEL_DEFAULT_KEYS,
    GenerateOptions,
    Untranslatable,
    generate_body,
    lora_adapter,
    model_options,
    read_sampling_defaults,
    sampling_params,
)
from tests.sglang_source import SGLang, load_sglang, or_skip

READ_PARAMETERS = {
    "type": "object",
    "properties": {"path": {"type": "string"}},
    "required": ["path"],
}
READ_FILE = {"type": "function", "function": {"name": "read_file", "parameters": READ_PARAMETERS}}
STRICT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "read_file", "parameters": READ_PARAMETERS, "strict": True},
    }
]
LIST_DIR = {"type": "function", "function": {"name": "list_dir"}}  # no parameters
TOOLS = [READ_FILE, LIST_DIR]
NAMED = {"type": "function", "function": {"name": "list_dir"}}


def engine_request(
    params: Mapping[str, Any] | None = None,
    *,
    template_kwargs: Mapping[str, Any] | None = None,
    max_tokens: int | None = None,
    priority: int | None = None,
    experts_from: int | None = None,
) -> EngineRequest:
    return EngineRequest(
        params={"messages": [{"role": "user", "content": "hi"}], **(params or {})},
        input_ids=np.asarray([1, 2, 3], dtype=np.int32),
        template_kwargs=template_kwargs or {},
        vocab_size=1000,
        max_tokens=max_tokens,
        priority=priority,
        experts_from=experts_from,
    )


def sampling(
    params: Mapping[str, Any] | None = None,
    *,
    parsers: Parsers | None = None,
    defaults: Mapping[str, Any] | None = None,
    keeps_special_tokens: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    options = GenerateOptions(parsers or Parsers(), defaults or {}, keeps_special_tokens)
    request = engine_request(params, template_kwargs=template_kwargs, max_tokens=max_tokens)
    return sampling_params(request, options)


# ChatCompletionRequest.to_sampling_params (entrypoints/openai/protocol.py), in
# its key order, for a request that sets nothing: the OpenAI defaults
# (_DEFAULT_SAMPLING_PARAMS) and the request fields' own defaults.
DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "max_new_tokens": None,  # no limit; /generate would stop at 128 if it were omitted
    "min_new_tokens": 0,
    "stop": [],  # _process_messages with input_ids: request.stop or []
    "stop_token_ids": None,
    "stop_regex": None,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "regex": None,
    "ebnf": None,
    "n": 1,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "logit_bias": None,
    "custom_params": None,
    "sampling_seed": None,
    "spaces_between_special_tokens": True,
    "watermark": None,
}


# -- the sampling keys -------------------------------------------------------


def test_every_sampling_key_is_sent_explicitly_in_the_chat_routes_order() -> None:
    out = sampling()
    assert out == DEFAULTS
    assert list(out) == list(DEFAULTS)  # byte-for-byte the chat route's dict


def test_the_requests_own_values_are_sent_under_sglangs_names() -> None:
    out = sampling(
        {
            "temperature": 0.3,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "seed": 7,  # -> sampling_seed
            "min_tokens": 2,  # -> min_new_tokens
            "stop": "END",  # a plain string stays one (request.stop or [])
            "stop_token_ids": [5],
            "stop_regex": "x+",
            "ignore_eos": True,
            "logit_bias": {"5": -100.0},
            "custom_params": {"a": 1},
            "watermark": {"enabled": True},
            "n": 1,
        }
    )
    assert out == {
        **DEFAULTS,
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "sampling_seed": 7,
        "min_new_tokens": 2,
        "stop": "END",
        "stop_token_ids": [5],
        "stop_regex": "x+",
        "ignore_eos": True,
        "logit_bias": {"5": -100.0},
        "custom_params": {"a": 1},
        "watermark": {"enabled": True},
    }


@pytest.mark.parametrize(
    ("params", "remainder", "expected"),
    [
        ({"max_completion_tokens": 50, "max_tokens": 80}, None, 50),
        ({"max_tokens": 80}, None, 80),
        # `max_completion_tokens or max_tokens`: 0 is falsy and falls through.
        ({"max_completion_tokens": 0, "max_tokens": 7}, None, 7),
        ({}, 300, 300),  # the session cap's remainder, for a request that set no limit
        ({"max_tokens": 80}, 300, 80),  # the request's own limit wins
        ({}, None, None),  # explicit null: no limit, as on the chat route
    ],
    ids=[
        "completion-over-max",
        "max-tokens",
        "zero-falls-through",
        "remainder",
        "own-limit",
        "none",
    ],
)
def test_max_new_tokens(
    params: dict[str, Any], remainder: int | None, expected: int | None
) -> None:
    out = sampling(params, max_tokens=remainder)
    assert "max_new_tokens" in out and out["max_new_tokens"] == expected


# -- the model's generation_config defaults -----------------------------------


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data), "utf-8")


def test_read_sampling_defaults_takes_the_five_keys_that_are_set(tmp_path: Path) -> None:
    # ModelConfig.get_default_sampling_params: exactly these keys, when not None.
    write_json(
        tmp_path / "generation_config.json",
        {
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "repetition_penalty": 1.05,
            "min_p": None,
            "max_new_tokens": 99,
            "do_sample": True,
            "eos_token_id": [1, 2],
        },
    )
    assert MODEL_DEFAULT_KEYS == ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
    assert read_sampling_defaults(tmp_path) == {
        "repetition_penalty": 1.05,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def test_read_sampling_defaults_without_the_file_is_empty(tmp_path: Path) -> None:
    assert read_sampling_defaults(tmp_path) == {}


def test_read_sampling_defaults_refuses_a_file_that_is_not_an_object(tmp_path: Path) -> None:
    write_json(tmp_path / "generation_config.json", [1, 2])
    with pytest.raises(TypeError, match="not a JSON object"):
        read_sampling_defaults(tmp_path)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}),
        (
            {"temperature": 0.2, "top_k": 5},
            {"temperature": 0.2, "top_p": 0.95, "top_k": 5, "min_p": 0.0},
        ),
        # `value is None` decides, not falsiness: an explicit 0 is the request's.
        (
            {"temperature": 0, "min_p": 0},
            {"temperature": 0, "top_p": 0.95, "top_k": 20, "min_p": 0},
        ),
        # null is unset: the model's default applies.
        ({"temperature": None}, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}),
    ],
    ids=["model-over-openai", "request-over-model", "explicit-zero", "null-is-unset"],
)
def test_defaults_precedence_request_then_model_then_openai(
    tmp_path: Path, params: dict[str, Any], expected: dict[str, Any]
) -> None:
    # to_sampling_params.get_param: request value > model_generation_config > OpenAI.
    write_json(
        tmp_path / "generation_config.json", {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    )
    out = sampling(params, defaults=read_sampling_defaults(tmp_path))
    assert {k: out[k] for k in expected} == expected
    assert out["repetition_penalty"] == 1.0  # not in the model's file: OpenAI's


@pytest.mark.parametrize(
    ("config", "keeps"),
    [
        ({"model_type": "gpt_oss"}, True),
        ({"model_type": "gemma4"}, True),
        ({"model_type": "gemma4_unified"}, True),
        ({"model_type": "qwen3"}, False),
        ({"architectures": ["X"]}, False),
        (None, False),  # no config.json
        ("{not json", False),
        ([1, 2], False),
    ],
    ids=[
        "gpt-oss",
        "gemma4",
        "gemma4-unified",
        "qwen3",
        "no-model-type",
        "absent",
        "bad-json",
        "list",
    ],
)
def test_model_options_reads_config_model_type(tmp_path: Path, config: Any, keeps: bool) -> None:
    # serving_chat: is_gpt_oss / is_gemma4 from hf_config.model_type.
    if isinstance(config, str):
        (tmp_path / "config.json").write_text(config, "utf-8")
    elif config is not None:
        write_json(tmp_path / "config.json", config)
    write_json(tmp_path / "generation_config.json", {"temperature": 0.7})
    parsers = Parsers("qwen25")
    options = model_options(parsers, tmp_path)
    assert options == GenerateOptions(parsers, {"temperature": 0.7}, keeps_special_tokens=keeps)


def test_model_options_for_a_path_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    assert model_options(Parsers(), path) == GenerateOptions(Parsers(), {}, False)


# -- skip_special_tokens and spaces_between_special_tokens ---------------------


def bypass(tool_call: str | None = None, reasoning: str | None = None) -> Parsers:
    """A Parsers built without its start-up refusal: for rules whose parsers
    are all refused today, pinned in case one is admitted."""
    parsers = object.__new__(Parsers)
    object.__setattr__(parsers, "tool_call", tool_call)
    object.__setattr__(parsers, "reasoning", reasoning)
    return parsers


@pytest.mark.parametrize(
    ("params", "options", "expected"),
    [
        ({}, {}, True),
        ({"skip_special_tokens": False}, {}, False),
        ({"tools": TOOLS}, {}, False),  # tool_choice defaults to auto with tools
        ({"tools": TOOLS, "tool_choice": "auto"}, {}, False),
        ({"tools": TOOLS, "tool_choice": "required"}, {}, False),
        ({"tools": TOOLS, "tool_choice": NAMED}, {}, False),
        ({"tools": TOOLS, "tool_choice": "none"}, {}, True),
        ({"tools": TOOLS, "tool_choice": "none", "skip_special_tokens": False}, {}, False),
        ({"tools": []}, {}, True),  # no effective tools: nothing forced
        ({}, {"keeps_special_tokens": True}, False),  # gpt-oss, gemma4
        ({"skip_special_tokens": True}, {"keeps_special_tokens": True}, False),
        ({}, {"parsers": Parsers(reasoning="qwen3")}, True),  # qwen3 is not patched
        ({}, {"parsers": Parsers(reasoning="deepseek-r1")}, True),
        ({}, {"parsers": bypass(reasoning="apertus2509")}, False),
        ({}, {"parsers": bypass(reasoning="muse")}, False),
    ],
    ids=[
        "default",
        "agent-false",
        "tools",
        "tools-auto",
        "tools-required",
        "tools-named",
        "tools-none",
        "tools-none-agent-false",
        "empty-tools",
        "model-keeps",
        "model-keeps-over-agent",
        "qwen3-reasoning",
        "r1-reasoning",
        "apertus2509-reasoning",
        "muse-reasoning",
    ],
)
def test_skip_special_tokens(
    params: dict[str, Any], options: dict[str, Any], expected: bool
) -> None:
    # serving_chat._process_messages (model type; tools with tool_choice !=
    # "none") and _patch_reasoning_skip_special_tokens (reasoning parsers).
    assert sampling(params, **options)["skip_special_tokens"] is expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, True),
        ({"enable_thinking": False}, True),
        ({"spaces_between_special_tokens": False}, False),
    ],
    ids=["default", "other-kwargs", "false"],
)
def test_spaces_between_special_tokens_follows_the_template_kwargs(
    kwargs: dict[str, Any], expected: bool
) -> None:
    # to_sampling_params reads chat_template_kwargs; sglang-chat sends the kwargs
    # the prompt was rendered with (server defaults included) as those.
    out = sampling(template_kwargs=kwargs)
    assert out["spaces_between_special_tokens"] is expected


# -- response_format -----------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ä": {"type": "integer"}}, "required": ["ä"]}
LEGACY_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<call>", "schema": {"type": "object"}, "end": "</call>"}],
    "triggers": ["<call>"],
    "at_least_one": False,
}


@pytest.mark.parametrize(
    ("response_format", "key", "value"),
    [
        ({"type": "text"}, None, None),
        ({"type": "json_object"}, "json_schema", '{"type": "object"}'),
        (
            {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
            "json_schema",
            # convert_json_schema_to_str: json.dumps with its default separators
            # and ASCII escapes.
            '{"type": "object", "properties": {"\\u00e4": {"type": "integer"}}, '
            '"required": ["\\u00e4"]}',
        ),
        (LEGACY_TAG, "structural_tag", json.dumps(LEGACY_TAG)),
    ],
    ids=["text", "json-object", "json-schema", "structural-tag"],
)
def test_response_format_is_serialised_as_to_sampling_params_does(
    response_format: dict[str, Any], key: str | None, value: str | None
) -> None:
    out = sampling({"response_format": response_format})
    grammar = {k: out[k] for k in ("json_schema", "structural_tag") if k in out}
    assert grammar == ({} if key is None else {key: value})
    assert {k: v for k, v in out.items() if k not in grammar} == DEFAULTS


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        # serving_chat._validate_request's own message.
        (
            {"type": "json_schema", "json_schema": {"name": "s"}},
            "schema_ is required for json_schema response format request.",
        ),
        ({"type": "yaml"}, "response_format type 'yaml'"),
    ],
    ids=["json-schema-without-schema", "unknown-type"],
)
def test_a_response_format_sglang_refuses_is_refused(
    response_format: dict[str, Any], message: str
) -> None:
    with pytest.raises(Untranslatable, match=message):
        sampling({"response_format": response_format})


# -- tool_choice: the JSON-array constraint --------------------------------------


def item_schema(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """function_call/utils.py _get_tool_schema."""
    return {
        "properties": {
            "name": {"type": "string", "enum": [name]},
            "parameters": parameters or {"type": "object", "properties": {}},
        },
        "required": ["name", "parameters"],
    }


READ_ITEM = item_schema("read_file", READ_PARAMETERS)
LIST_ITEM = item_schema("list_dir")
A_PARAMETERS = {"type": "object", "$defs": {"P": {"type": "string"}}}
B_PARAMETERS = {"type": "object", "$defs": {"P": {"type": "string"}, "Q": {}}}
DEFS_A = {"type": "function", "function": {"name": "a", "parameters": A_PARAMETERS}}
DEFS_B = {"type": "function", "function": {"name": "b", "parameters": B_PARAMETERS}}


@pytest.mark.parametrize(
    ("params", "schema"),
    [
        (
            {"tools": TOOLS, "tool_choice": "required"},
            {
                "type": "array",
                "minItems": 1,
                "items": {"type": "object", "anyOf": [READ_ITEM, LIST_ITEM]},
            },
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
            {
                "type": "array",
                "minItems": 1,
                "items": {"type": "object", "anyOf": [READ_ITEM, LIST_ITEM]},
                "maxItems": 1,
            },
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED},
            {"type": "array", "minItems": 1, "items": LIST_ITEM},
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False},
            {"type": "array", "minItems": 1, "items": LIST_ITEM, "maxItems": 1},
        ),
        (
            # $defs of every tool merged (an identical one twice is fine), after maxItems.
            {"tools": [DEFS_A, DEFS_B], "tool_choice": "required", "parallel_tool_calls": False},
            {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "anyOf": [
                        item_schema("a", A_PARAMETERS),
                        item_schema("b", B_PARAMETERS),
                    ],
                },
                "maxItems": 1,
                "$defs": {"P": {"type": "string"}, "Q": {}},
            },
        ),
        (
            # Named: the one tool's schema as given; no $defs merge.
            {
                "tools": [DEFS_A, DEFS_B],
                "tool_choice": {"type": "function", "function": {"name": "b"}},
            },
            {
                "type": "array",
                "minItems": 1,
                "items": item_schema("b", B_PARAMETERS),
            },
        ),
    ],
    ids=[
        "required",
        "required-sequential",
        "named",
        "named-sequential",
        "defs-merged",
        "named-defs",
    ],
)
@pytest.mark.parametrize("parser", [None, "pythonic", "glm45", "lfm2"])
def test_forced_tool_choice_is_the_json_array_schema(
    params: dict[str, Any], schema: dict[str, Any], parser: str | None
) -> None:
    # function_call/utils.py get_json_schema_constraint, serialised with
    # json.dumps (convert_json_schema_to_str): the key order is part of it.
    out = sampling(params, parsers=Parsers(tool_call=parser))
    assert out["json_schema"] == json.dumps(schema)
    assert out["skip_special_tokens"] is False
    assert "structural_tag" not in out


def test_conflicting_defs_are_refused() -> None:
    other = {
        "type": "function",
        "function": {"name": "c", "parameters": {"$defs": {"P": {"type": "integer"}}}},
    }
    with pytest.raises(Untranslatable, match=r"\$defs\.P"):
        sampling({"tools": [DEFS_A, other], "tool_choice": "required"})


@pytest.mark.parametrize(
    ("params", "parser"),
    [
        ({"tools": TOOLS}, None),
        ({"tools": TOOLS, "tool_choice": "auto"}, "qwen25"),
        ({"tools": TOOLS, "tool_choice": "none"}, "qwen25"),
        ({"tools": TOOLS, "tool_choice": "none"}, None),
        # strict auto: only a structural-tag parser constrains it (should_constrain_auto).
        ({"tools": STRICT_TOOLS}, None),
        ({"tools": STRICT_TOOLS}, "pythonic"),
    ],
    ids=["auto", "auto-qwen25", "none-qwen25", "none", "strict-auto", "strict-auto-pythonic"],
)
def test_unforced_tool_choice_is_not_constrained(
    params: dict[str, Any], parser: str | None
) -> None:
    out = sampling(params, parsers=Parsers(tool_call=parser))
    assert "json_schema" not in out and "structural_tag" not in out


# -- the legacy structural tag (qwen25, hermes, llama3, mistral, deepseekv3/v31) --


@pytest.mark.parametrize(
    ("params", "at_least_one"),
    [
        ({"tools": TOOLS, "tool_choice": "required"}, True),
        ({"tools": TOOLS, "tool_choice": NAMED}, True),  # not narrowed to the named tool
        ({"tools": STRICT_TOOLS}, False),  # strict auto
    ],
    ids=["required", "named", "strict-auto"],
)
def test_the_legacy_structural_tag_is_built_as_sglang_builds_it(
    params: dict[str, Any], at_least_one: bool
) -> None:
    tag = json.loads(sampling(params, parsers=Parsers("qwen25"))["structural_tag"])
    tools = params["tools"]
    assert tag == {
        "type": "structural_tag",
        "structures": [
            {
                "begin": '<tool_call>\n{"name":"' + t["function"]["name"] + '", "arguments":',
                # Arguments are schema-free unless the tool is strict.
                "schema": t["function"]["parameters"] if t["function"].get("strict") else {},
                "end": "}\n</tool_call>",
            }
            for t in tools
        ],
        "triggers": ["<tool_call>"],
        "at_least_one": at_least_one,
    }


@pytest.mark.parametrize("parser", sorted(LEGACY_TAGS))
def test_legacy_tag_parts_are_the_detectors_structure_info(parser: str, sglang: SGLang) -> None:
    """Each part is a string constant of the detector's `structure_info` in
    SGLang's source (read, not imported: the detectors import torch)."""
    detector = {
        "qwen": "qwen25",
        "qwen25": "qwen25",
        "hermes": "hermes",
        "llama3": "llama32",
        "mistral": "mistral",
        "deepseekv3": "deepseekv3",
        "deepseekv31": "deepseekv31",
    }[parser]
    tree = ast.parse(
        (sglang.root / "srt" / "function_call" / f"{detector}_detector.py").read_text()
    )
    [function] = [
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "structure_info"
    ]
    constants = {
        n.value
        for n in ast.walk(function)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    before, after, end, trigger = LEGACY_TAGS[parser]
    assert {before, after, end, trigger} <= constants


# -- what the chat route does that is refused ------------------------------------


@pytest.mark.parametrize(
    ("params", "parsers", "message"),
    [
        # FunctionCallParser.get_structure_constraint: the model's own xgrammar tag.
        ({"tools": TOOLS, "tool_choice": "required"}, Parsers("kimi_k2"), "structural tag"),
        ({"tools": TOOLS, "tool_choice": NAMED}, Parsers("qwen3_coder"), "structural tag"),
        ({"tools": STRICT_TOOLS}, Parsers("kimi_k2"), "structural tag"),  # strict auto
        # Parsed natively with no constraint (parses_required_natively): not reproduced.
        ({"tools": TOOLS, "tool_choice": "required"}, Parsers("hunyuan"), "structural tag"),
        # serving_chat._validate_request.
        (
            {"tool_choice": "required"},
            Parsers(),
            "Tools cannot be empty if tool choice is set to required.",
        ),
        (
            {"tools": [], "tool_choice": NAMED},
            Parsers(),
            "Tools cannot be empty if tool choice is set to a specific tool.",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
            Parsers(),
            "Tool 'rm' not found in tools list.",
        ),
        # Request fields whose effect this engine does not reproduce.
        ({"top_logprobs": 3}, Parsers(), "top_logprobs"),
        ({"reasoning_effort": "low"}, Parsers(), "reasoning_effort"),
        ({"reasoning": {"effort": "high"}}, Parsers(), "reasoning"),
        ({"continue_final_message": True}, Parsers(), "continue_final_message"),
        ({"return_hidden_states": True}, Parsers(), "return_hidden_states"),
        ({"custom_logit_processor": "p"}, Parsers(), "custom_logit_processor"),
        ({"separate_reasoning": False}, Parsers(reasoning="qwen3"), "separate_reasoning"),
    ],
    ids=[
        "required-kimi_k2",
        "named-qwen3_coder",
        "strict-auto-kimi_k2",
        "required-hunyuan",
        "required-without-tools",
        "named-without-tools",
        "named-not-offered",
        "top-logprobs",
        "reasoning-effort",
        "reasoning",
        "continue-final-message",
        "hidden-states",
        "logit-processor",
        "separate-reasoning-false",
    ],
)
def test_refused(params: dict[str, Any], parsers: Parsers, message: str) -> None:
    with pytest.raises(Untranslatable, match=message.replace("(", r"\(").replace(".", r"\.")):
        sampling(params, parsers=parsers)


@pytest.mark.parametrize(
    "params",
    [
        {"top_logprobs": 0},
        {"top_logprobs": None},
        {"continue_final_message": False},
        {"return_hidden_states": False},
        {"separate_reasoning": False},  # no reasoning parser: nothing to separate
        {"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"}},
        # auto: the chat route drops its (absent) tool constraint and keeps the format.
        {"tools": TOOLS, "response_format": {"type": "json_object"}},
    ],
    ids=[
        "top-logprobs-0",
        "top-logprobs-null",
        "no-continue",
        "no-hidden-states",
        "separate-reasoning-no-parser",
        "none-with-format",
        "auto-with-format",
    ],
)
def test_not_refused(params: dict[str, Any]) -> None:
    sampling(params)


@pytest.mark.parametrize(
    "other",
    [
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            }
        },
        {"response_format": LEGACY_TAG},
        {"regex": "a+"},
        {"ebnf": 'root ::= "a"'},
    ],
    ids=["json-object", "json-schema", "structural-tag", "regex", "ebnf"],
)
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_choice_with_another_constraint_is_the_chat_routes_error(
    other: dict[str, Any], choice: Any
) -> None:
    # to_sampling_params: has_existing_constraints with a required/named tool.
    with pytest.raises(Untranslatable, match="cannot be combined with response_format, regex"):
        sampling({"tools": TOOLS, "tool_choice": choice, **other})


# -- Parsers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "nope",
        # Detectors that override the parse or hard-code force_reasoning
        # (srt/parser/reasoning_parser.py).
        "gpt-oss",
        "kimi",
        "gemma4",
        "minimax-append-think",
        "qwen3-thinking",
        # Reasoning parsers after which the chat route keeps special tokens.
        "apertus2509",
        "kimi_k3",
        "inkling",
        "muse",
    ],
)
def test_a_reasoning_parser_not_reproduced_is_refused_at_start_up(name: str) -> None:
    with pytest.raises(ValueError, match="sglang-chat"):
        Parsers(reasoning=name)


@pytest.mark.parametrize("name", ["kimi_k3", "glm47", "inkling", "beam", "response_template"])
def test_a_tool_call_parser_not_reproduced_is_refused_at_start_up(name: str) -> None:
    # kimi_k3: its eot stop string and renderer; glm47: the full-assistant EBNF
    # on every tool turn (`ebnf_full_assistant` fails /generate's gate); inkling:
    # a structural tag for auto; beam/response_template: response templates.
    with pytest.raises(ValueError, match=f"'{name}'.*sglang-chat"):
        Parsers(tool_call=name)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_the_supported_reasoning_parsers(name: str) -> None:
    parsers = Parsers(reasoning=name)
    assert parsers.think_start == "<think>"
    assert parsers.reasoning_needs_special_tokens is False
    assert Parsers().think_start == ""


@pytest.mark.parametrize(
    ("name", "kwargs", "forced"),
    [
        (None, {"enable_thinking": True}, False),
        # DeepSeekR1Detector hard-codes force_reasoning=True ("always").
        ("deepseek-r1", {}, True),
        ("deepseek-r1", {"thinking": False, "enable_thinking": False}, True),
        # "enable_thinking": forced unless it is False.
        ("qwen3", {}, True),
        ("qwen3", {"enable_thinking": True}, True),
        ("qwen3", {"enable_thinking": None}, True),
        ("qwen3", {"enable_thinking": False}, False),
        ("qwen3", {"thinking": False}, True),  # not qwen3's toggle
        ("glm45", {}, True),
        ("glm45", {"enable_thinking": False}, False),
        # "thinking".
        ("kimi_k2", {}, True),
        ("kimi_k2", {"thinking": False}, False),
        ("kimi_k2", {"enable_thinking": False}, True),
        # "explicit_thinking": forced only if it is True.
        ("deepseek-v3", {}, False),
        ("deepseek-v3", {"thinking": True}, True),
        ("deepseek-v3", {"thinking": "true"}, False),
        ("deepseek-v3", {"thinking": 1}, False),
        ("deepseek-v3", {"enable_thinking": True}, False),
    ],
    ids=[
        "no-parser",
        "r1",
        "r1-off-ignored",
        "qwen3",
        "qwen3-on",
        "qwen3-null",
        "qwen3-off",
        "qwen3-other-key",
        "glm45",
        "glm45-off",
        "kimi_k2",
        "kimi_k2-off",
        "kimi_k2-other-key",
        "v3",
        "v3-on",
        "v3-string",
        "v3-one",
        "v3-other-key",
    ],
)
def test_forces_reasoning_follows_the_detectors_reasoning_default(
    name: str | None, kwargs: dict[str, Any], forced: bool
) -> None:
    # serving_chat._get_reasoning_from_request's fallback on the detector's
    # reasoning_default (srt/parser/reasoning_parser.py).
    assert Parsers(reasoning=name).forces_reasoning(kwargs) is forced


@pytest.mark.parametrize(
    ("name", "natively", "as_json", "kimi_ids"),
    [
        (None, False, False, False),
        ("qwen25", True, False, False),
        ("hermes", True, False, False),
        ("llama3", True, False, False),
        ("kimi_k2", True, False, True),
        ("pythonic", False, True, False),
        ("glm45", False, True, False),
        ("lfm2", False, True, False),  # Lfm2Detector.supports_structural_tag is False
        ("gemma4", False, True, False),
    ],
)
def test_tool_call_parser_properties(
    name: str | None, natively: bool, as_json: bool, kimi_ids: bool
) -> None:
    parsers = Parsers(tool_call=name)
    assert parsers.tool_call_constrains_natively is natively
    assert parsers.parses_required_as_json is as_json
    assert parsers.kimi_ids is kimi_ids


# -- the /generate body ----------------------------------------------------------------


def test_generate_body_asks_what_the_chat_route_asks() -> None:
    request = engine_request({"temperature": 0.5})
    body = orjson.loads(
        generate_body(
            request, GenerateOptions(Parsers()), rid="r1", require_reasoning=True, session_hint=None
        )
    )
    # serving_chat._convert_to_internal_request with the input_ids path.
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {**DEFAULTS, "temperature": 0.5},
        "rid": "r1",
        "return_logprob": True,  # sglang-chat asks logprobs: true
        "logprob_start_len": -1,
        "return_text_in_logprobs": True,  # always True on the chat route
        "require_reasoning": True,
        "stream": False,
    }


def test_generate_body_optional_fields() -> None:
    request = engine_request({"lora_path": "adapter"}, priority=3, experts_from=2)
    body = orjson.loads(
        generate_body(
            request, GenerateOptions(Parsers()), rid="r", require_reasoning=False, session_hint="s1"
        )
    )
    assert body["priority"] == 3
    assert (body["return_routed_experts"], body["routed_experts_start_len"]) == (True, 2)
    assert body["session_id"] == "s1"
    assert body["lora_path"] == "adapter"


def test_generate_body_refuses_what_the_translation_refuses() -> None:
    request = engine_request({"top_logprobs": 2})
    with pytest.raises(Untranslatable):
        generate_body(
            request, GenerateOptions(Parsers()), rid="r", require_reasoning=False, session_hint=None
        )


# -- against SGLang's own code ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang() -> SGLang:
    return or_skip(load_sglang)


ORACLE_CASES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    # (id, request params, model generation_config defaults, chat_template_kwargs)
    ("defaults", {}, {}, {}),
    (
        "everything",
        {
            "temperature": 0.3,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "seed": 7,
            "stop": "END",
            "stop_token_ids": [5],
            "stop_regex": ["x+"],
            "min_tokens": 2,
            "max_completion_tokens": 64,
            "max_tokens": 99,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "logit_bias": {"5": -100.0},
            "custom_params": {"a": 1},
            "watermark": {"enabled": True},
        },
        {},
        {},
    ),
    ("max-tokens", {"max_tokens": 99, "stop": ["a", "b"]}, {}, {}),
    ("model-defaults", {"top_p": 0.8}, {"temperature": 0.6, "top_k": 20, "min_p": 0.01}, {}),
    ("explicit-zero", {"temperature": 0.0}, {"temperature": 0.6}, {}),
    ("spaces", {}, {}, {"spaces_between_special_tokens": False}),
    ("tools-auto", {"tools": TOOLS}, {}, {}),
    ("tools-none", {"tools": TOOLS, "tool_choice": "none"}, {}, {}),
    ("required", {"tools": TOOLS, "tool_choice": "required"}, {}, {}),
    (
        "named-sequential",
        {"tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False},
        {},
        {},
    ),
    (
        "required-defs-sequential",
        {"tools": [DEFS_A, DEFS_B], "tool_choice": "required", "parallel_tool_calls": False},
        {},
        {},
    ),
    ("strict-auto", {"tools": STRICT_TOOLS}, {}, {}),
    ("json-object", {"response_format": {"type": "json_object"}}, {}, {}),
    (
        "json-schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            }
        },
        {},
        {},
    ),
    ("structural-tag", {"response_format": LEGACY_TAG}, {}, {}),
    ("regex", {"regex": "[ab]+"}, {}, {}),
    ("ebnf", {"ebnf": 'root ::= "a"'}, {}, {}),
    ("auto-with-format", {"tools": TOOLS, "response_format": {"type": "json_object"}}, {}, {}),
]


class TestAgainstSGLang:
    """No --tool-call-parser: the chat route's tool constraint is the
    JSON-array fallback of serving_chat._process_messages."""

    @staticmethod
    def theirs(
        sglang: SGLang, params: dict[str, Any], defaults: dict[str, Any], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        request = sglang.protocol.ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}],
            input_ids=[1, 2, 3],
            chat_template_kwargs=kwargs or None,
            **params,
        )
        # serving_chat._process_messages, what it does before to_sampling_params.
        constraint = None
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
            if request.tool_choice == "required" or isinstance(
                request.tool_choice, sglang.protocol.ToolChoice
            ):
                schema = sglang.json_schema_constraint(
                    request.tools,
                    request.tool_choice,
                    parallel_tool_calls=request.parallel_tool_calls,
                )
                constraint = ("json_schema", schema)
        result: dict[str, Any] = request.to_sampling_params(
            stop=request.stop or [],
            model_generation_config=defaults,
            tool_call_constraint=constraint,
        )
        return result

    @pytest.mark.parametrize(
        ("params", "defaults", "kwargs"),
        [case[1:] for case in ORACLE_CASES],
        ids=[case[0] for case in ORACLE_CASES],
    )
    def test_sampling_params_are_sglangs(
        self,
        sglang: SGLang,
        params: dict[str, Any],
        defaults: dict[str, Any],
        kwargs: dict[str, Any],
    ) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # max_tokens is deprecated
            theirs = self.theirs(sglang, params, defaults, kwargs)
        ours = sampling(params, defaults=defaults, template_kwargs=kwargs)
        assert ours == theirs
        assert list(ours) == list(theirs)

    @pytest.mark.parametrize(
        ("params", "defaults", "kwargs"),
        [case[1:] for case in ORACLE_CASES],
        ids=[case[0] for case in ORACLE_CASES],
    )
    def test_the_body_passes_the_generate_contract_gate(
        self,
        sglang: SGLang,
        params: dict[str, Any],
        defaults: dict[str, Any],
        kwargs: dict[str, Any],
    ) -> None:
        request = engine_request(
            {**params, "lora_path": "adapter"}, template_kwargs=kwargs, priority=1, experts_from=0
        )
        options = GenerateOptions(Parsers(), defaults)
        body = generate_body(request, options, rid="r", require_reasoning=True, session_hint="s")
        sglang.api_types.GenerateRequest.from_json_value(orjson.loads(body))

    def test_conflicting_defs_are_refused_by_sglang_too(self, sglang: SGLang) -> None:
        tools = [
            sglang.protocol.Tool.model_validate(t)
            for t in (DEFS_A, {"function": {"name": "c", "parameters": {"$defs": {"P": {}}}}})
        ]
        with pytest.raises(ValueError, match="multiple schemas"):
            sglang.json_schema_constraint(tools, "required")

    def test_the_json_array_parsers_are_sglangs(self, sglang: SGLang) -> None:
        """Parsers whose required/named tool_choice the chat route constrains with
        get_json_schema_constraint and parses as a JSON array: the detector's
        supports_structural_tag() is False, it does not parse required natively
        and has no required-tool parser of its own (function_call/*.py)."""
        expected = {
            name
            for name, detector in _tool_call_parsers(sglang.root).items()
            if _returns(detector, "supports_structural_tag") is False
            and _returns(detector, "parses_required_natively") is not True
            and _defined_in(detector, "get_required_tool_parser") == "BaseFormatDetector"
        }
        refused = {"kimi_k3", "glm47", "inkling", "beam", "response_template"}
        as_json = {
            name
            for name in _tool_call_parsers(sglang.root)
            if name not in refused and Parsers(tool_call=name).parses_required_as_json
        }
        assert as_json == expected


# Static reading of SGLang's function_call package: its classes import the GPU stack.

_Methods = dict[str, tuple[list[str], dict[str, ast.FunctionDef]]]


def _function_call_classes(root: Path) -> _Methods:
    classes: _Methods = {}
    for path in sorted((root / "srt" / "function_call").glob("*.py")):
        for node in ast.parse(path.read_text("utf-8")).body:
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
                classes[node.name] = (bases, methods)
    return classes


def _tool_call_parsers(root: Path) -> dict[str, tuple[_Methods, str]]:
    """FunctionCallParser.ToolCallParserEnum: name -> (classes, detector class)."""
    classes = _function_call_classes(root)
    source = (root / "srt" / "function_call" / "function_call_parser.py").read_text("utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "ToolCallParserEnum":
            assert isinstance(node.value, ast.Dict)
            return {
                ast.literal_eval(k): (classes, ast.unparse(v))
                for k, v in zip(node.value.keys, node.value.values, strict=True)
                if k is not None
            }
    raise AssertionError("ToolCallParserEnum not found")


def _defined_in(detector: tuple[_Methods, str], method: str) -> str | None:
    classes, name = detector
    queue = [name]
    while queue:
        current = queue.pop(0)
        if current not in classes:
            continue
        bases, methods = classes[current]
        if method in methods:
            return current
        queue.extend(bases)
    return None


def _returns(detector: tuple[_Methods, str], method: str) -> object:
    """The constant `method` returns, if its body is only ``return <constant>``
    (after a docstring); else a marker that equals nothing."""
    owner = _defined_in(detector, method)
    if owner is None:
        return NotImplemented
    body = [
        s
        for s in detector[0][owner][1][method].body
        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    ]
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return NotImplemented
    value = body[0].value
    return value.value if isinstance(value, ast.Constant) else NotImplemented


def test_no_stop_trim_is_the_servers_as_on_sglang_chat() -> None:
    # engines/sglang_chat/engine.py forces it false; an agent's true would
    # make the two engines' answer texts differ.
    assert sampling({"no_stop_trim": True})["no_stop_trim"] is False


@pytest.mark.parametrize(
    ("model", "served", "explicit", "adapter"),
    [
        ("m", "m", "given", "given"),  # no adapter in the name: lora_path stays
        ("m:sql", "m", None, "sql"),
        ("m:sql", "m", "given", "sql"),  # the model parameter wins (_resolve_lora_path)
        ("s3://b/m:x", "s3://b/m", None, "x"),  # the served name may hold colons
        ("s3://b/m", "s3://b/m", None, None),
        ("other:lora", "m", None, "lora"),
        ("m:", "m", "given", "given"),
        (None, "m", None, None),
    ],
    ids=["plain", "adapter", "adapter-wins", "uri", "uri-served", "other-base", "empty", "none"],
)
def test_a_lora_adapter_is_resolved_as_the_chat_route_does(
    model: str | None, served: str, explicit: str | None, adapter: str | None
) -> None:
    assert lora_adapter(model, served, explicit) == adapter
    body = orjson.loads(
        generate_body(
            engine_request({"lora_path": explicit} if explicit else {}),
            GenerateOptions(Parsers()),
            rid="r",
            require_reasoning=False,
            model=model,
            served_model=served,
        )
    )
    assert body.get("lora_path") == adapter


_DETECTOR_FILES = {
    "qwen": "qwen25",
    "qwen25": "qwen25",
    "hermes": "hermes",
    "llama3": "llama32",
    "mistral": "mistral",
    "deepseekv3": "deepseekv3",
    "deepseekv31": "deepseekv31",
}


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_MARKERS))
def test_tool_call_markers_are_the_detectors(parser: str, sglang: SGLang) -> None:
    """The marker is a string constant of the detector's module in SGLang's
    source, and `may_call` agrees with its has_tool_call on both sides."""
    source = sglang.root / "srt" / "function_call" / f"{_DETECTOR_FILES[parser]}_detector.py"
    constants = {
        n.value
        for n in ast.walk(ast.parse(source.read_text("utf-8")))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    marker = TOOL_CALL_MARKERS[parser]
    assert marker in constants
    parsers = Parsers(tool_call=parser)
    assert parsers.may_call(f"Sure. {marker} and more")
    assert not parsers.may_call("A plain answer.")
    assert parsers.may_call('{"name": "f"}') is (parser == "llama3")


def test_parsers_without_a_known_marker_are_always_asked() -> None:
    assert Parsers(tool_call="pythonic").may_call("A plain answer.")


def test_a_model_dir_without_generation_config_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        options = model_options(Parsers(), tmp_path)
    assert options.model_defaults == {}
    [record] = [r for r in caplog.records if "generation_config.json" in r.getMessage()]
    assert str(tmp_path) in record.getMessage()
    caplog.clear()
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        assert model_options(Parsers(), tmp_path).model_defaults == {"temperature": 0.6}
    assert not caplog.records
