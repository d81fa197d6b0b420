"""The ``/generate`` request SGLang's chat route would have built.

SGLang 0.5.23's chat route turns an OpenAI request into a native request
(``serving_chat.OpenAIServingChat._convert_to_internal_request``,
``_process_messages``) with ``ChatCompletionRequest.to_sampling_params``
(``entrypoints/openai/protocol.py``). This module does the same from the
agent's parsed request, key by key, and sends every sampling key
explicitly: ``/generate`` itself fills an omitted key differently (128 new
tokens; the worker's ``--preferred-sampling-params``) and never applies the
model's ``generation_config`` defaults, which the chat route does under
SGLang's default ``--sampling-defaults model``.

What the chat route would do that cannot be reproduced here is refused per
request with `Untranslatable` (docs/engines.md#sglang-generate lists each
case and why); nothing is sent that would sample differently.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from ...tokens import IdArray
from ..base import EngineRequest
from .parsers import Parsers

__all__ = [
    "MODEL_DEFAULT_KEYS",
    "GenerateOptions",
    "ToolChoice",
    "Untranslatable",
    "generate_body",
    "lora_adapter",
    "model_options",
    "read_sampling_defaults",
    "sampling_params",
]

# The keys the chat route takes from the model's generation_config.json when
# the request leaves them unset (ModelConfig.get_default_sampling_params),
# and the OpenAI defaults after that (ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS).
MODEL_DEFAULT_KEYS: Final = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
_OPENAI_DEFAULTS: Final[Mapping[str, float | int]] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# Request keys the chat route reads that this engine does not reproduce.
_REFUSED: Final[Mapping[str, str]] = {
    "top_logprobs": "top logprobs (output_top_logprobs) are not rebuilt into the answer",
    "continue_final_message": "the reasoning parser's previous_content is not passed to "
    "SGLang's /separate_reasoning",
    "reasoning_effort": "normalize_reasoning_inputs changes the reasoning parser's inputs, "
    "which SGLang's /separate_reasoning does not take",
    "reasoning": "normalize_reasoning_inputs turns it into reasoning_effort and thinking "
    "kwargs, which change the reasoning parser's inputs",
    "return_hidden_states": "hidden states are not part of a trajectory",
    "custom_logit_processor": "not forwarded by this engine",
}


logger = logging.getLogger("rollout_session")


class Untranslatable(Exception):
    """The chat route would do something `/generate` cannot be made to do."""


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """What the translation needs besides the request."""

    parsers: Parsers
    # The model's generation_config sampling defaults (MODEL_DEFAULT_KEYS).
    model_defaults: Mapping[str, Any] = field(default_factory=dict)
    # The model needs special tokens in the text (SGLang: gpt-oss, gemma4).
    keeps_special_tokens: bool = False


def read_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """generation_config.json's sampling defaults, as SGLang reads them (none
    when the file is absent)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return {}
    if not isinstance(config, dict):
        raise TypeError(f"{path} is not a JSON object")
    return {k: config[k] for k in MODEL_DEFAULT_KEYS if config.get(k) is not None}


def _tool_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    """serving's function_call/utils.py `_get_tool_schema`."""
    return {
        "properties": {
            "name": {"type": "string", "enum": [function["name"]]},
            "parameters": function.get("parameters") or {"type": "object", "properties": {}},
        },
        "required": ["name", "parameters"],
    }


def _check_defs(tools: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The tools' `$defs`, merged (function_call/utils.py `_get_tool_schema_defs`).
    Conflicting ones make SGLang log an error and sample unconstrained
    (get_structure_constraint catches it): refused here instead."""
    defs: dict[str, Any] = {}
    for tool in tools:
        for key, value in ((tool["function"].get("parameters") or {}).get("$defs") or {}).items():
            if key in defs and defs[key] != value:
                raise Untranslatable(f"tools define '$defs.{key}' differently")
            defs[key] = value
    return defs


def _json_schema_constraint(
    tools: list[Mapping[str, Any]], tool_choice: Any, parallel: bool
) -> dict[str, Any]:
    """function_call/utils.py `get_json_schema_constraint`."""
    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = next(f for f in functions if f["name"] == name)
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": _tool_schema(chosen)}
    else:
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": [_tool_schema(f) for f in functions]},
        }
        if not parallel:
            schema["maxItems"] = 1
        defs = _check_defs(tools)
        if defs:
            schema["$defs"] = defs
        return schema
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _legacy_tag(
    tools: list[Mapping[str, Any]], tag: tuple[str, str, str, str], *, at_least_one: bool
) -> dict[str, Any]:
    """FunctionCallParser.get_legacy_structural_tag, as
    LegacyStructuralTagResponseFormat.model_dump(by_alias=True) writes it:
    one structure per tool (a named tool_choice does not narrow it), the
    parameters' schema only for strict tools."""
    _check_defs(tools)
    before, after, end, trigger = tag
    structures = []
    for tool in tools:
        function = tool["function"]
        schema = function.get("parameters") if function.get("strict") else {}
        structures.append(
            {"begin": before + function["name"] + after, "schema": schema or {}, "end": end}
        )
    return {
        "type": "structural_tag",
        "structures": structures,
        "triggers": [trigger],
        "at_least_one": at_least_one,
    }


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's tools and `tool_choice`, as the chat route reads them."""

    tools: list[Mapping[str, Any]]
    # ChatCompletionRequest.set_tool_choice_default: "auto" with tools, else "none".
    choice: Any

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> ToolChoice:
        tools = params.get("tools") or []
        return cls(tools, params.get("tool_choice", "auto" if tools else "none"))

    @property
    def active(self) -> bool:
        """Tools are offered and may be called (the parser's turn, when one is set)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """`required` or a named function."""
        return self.choice == "required" or isinstance(self.choice, dict)


def _tool_constraint(params: Mapping[str, Any], parsers: Parsers) -> tuple[str, str] | None:
    """The constraint the chat route samples `tool_choice` under, serialised."""
    request = ToolChoice.of(params)
    tools, choice = request.tools, request.choice
    if choice == "required" and not tools:  # serving_chat._validate_request
        raise Untranslatable("Tools cannot be empty if tool choice is set to required.")
    if isinstance(choice, dict):
        if not tools:
            raise Untranslatable("Tools cannot be empty if tool choice is set to a specific tool.")
        name = (choice.get("function") or {}).get("name")
        if not any((t.get("function") or {}).get("name") == name for t in tools):
            raise Untranslatable(f"Tool '{name}' not found in tools list.")
    if not request.active:
        return None
    forced = request.forced
    strict = any((t.get("function") or {}).get("strict") for t in tools)
    if not forced and not strict:
        return None
    tag = parsers.legacy_tag
    if tag is not None:
        return "structural_tag", json.dumps(_legacy_tag(tools, tag, at_least_one=forced))
    if parsers.tool_call is not None and parsers.tool_call_constrains_natively:
        what = "strict tools" if not forced else f"tool_choice {choice!r}"
        raise Untranslatable(
            f"{what} under --tool-call-parser {parsers.tool_call} are constrained by the "
            "parser's own structural tag (xgrammar), which this engine does not build; "
            "use --engine sglang-chat"
        )
    if not forced:
        return None  # strict auto: only structural-tag parsers constrain it
    parallel = params.get("parallel_tool_calls", True) is not False
    schema = _json_schema_constraint(tools, choice, parallel)
    return "json_schema", json.dumps(schema)


def _response_format(params: Mapping[str, Any]) -> tuple[str, str] | None:
    fmt = params.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise Untranslatable("schema_ is required for json_schema response format request.")
        return "json_schema", json.dumps(schema)
    if kind == "structural_tag":
        return "structural_tag", json.dumps(fmt)
    raise Untranslatable(f"response_format type {kind!r} is not one SGLang knows")


def sampling_params(request: EngineRequest, options: GenerateOptions) -> dict[str, Any]:
    """`ChatCompletionRequest.to_sampling_params`, every key explicit."""
    params = request.params
    for key, why in _REFUSED.items():
        if params.get(key) not in (None, False, 0):
            raise Untranslatable(f"{key}: {why}; use --engine sglang-chat")
    if params.get("separate_reasoning") is False and options.parsers.reasoning is not None:
        raise Untranslatable("separate_reasoning false: use --engine sglang-chat")

    def pick(key: str) -> Any:
        value = params.get(key)
        if value is not None:
            return value
        return options.model_defaults.get(key, _OPENAI_DEFAULTS[key])

    max_new = params.get("max_completion_tokens") or params.get("max_tokens")
    if max_new is None:
        max_new = request.max_tokens  # the session cap's remainder; None: no limit
    kwargs = request.template_kwargs  # what sglang-chat sends as chat_template_kwargs
    skip_special = params.get("skip_special_tokens", True)
    if options.keeps_special_tokens or ToolChoice.of(params).active:
        skip_special = False  # serving_chat._process_messages
    if options.parsers.reasoning_needs_special_tokens:
        skip_special = False  # serving_chat._patch_reasoning_skip_special_tokens
    out: dict[str, Any] = {
        "temperature": pick("temperature"),
        "max_new_tokens": max_new,
        "min_new_tokens": params.get("min_tokens", 0),
        "stop": params.get("stop") or [],
        "stop_token_ids": params.get("stop_token_ids"),
        "stop_regex": params.get("stop_regex"),
        "top_p": pick("top_p"),
        "top_k": pick("top_k"),
        "min_p": pick("min_p"),
        "presence_penalty": params.get("presence_penalty", 0.0),
        "frequency_penalty": params.get("frequency_penalty", 0.0),
        "repetition_penalty": pick("repetition_penalty"),
        "regex": params.get("regex"),
        "ebnf": params.get("ebnf"),
        "n": 1,
        "no_stop_trim": False,  # the server owns it, as sglang-chat forces it
        "ignore_eos": params.get("ignore_eos", False),
        "skip_special_tokens": skip_special,
        "logit_bias": params.get("logit_bias"),
        "custom_params": params.get("custom_params"),
        "sampling_seed": params.get("seed"),
        "spaces_between_special_tokens": kwargs.get("spaces_between_special_tokens", True),
        "watermark": params.get("watermark"),
    }
    existing = any(out.get(k) for k in ("regex", "ebnf"))
    response = _response_format(params)
    if response is not None:
        out[response[0]] = response[1]
        existing = True
    tool = _tool_constraint(params, options.parsers)
    if tool is not None:
        if existing:
            raise Untranslatable(
                "tool_choice 'required' or a named tool cannot be combined with "
                "response_format, regex, or ebnf"
            )
        out[tool[0]] = tool[1]
    return out


def lora_adapter(model: str | None, served: str | None, explicit: Any) -> Any:
    """The LoRA adapter the chat route would use: the one a ``base:adapter``
    model names, over an explicit ``lora_path`` (serving_base
    ``_resolve_lora_path``, ``_parse_model_parameter``)."""
    if not model or ":" not in model or model == served:
        return explicit
    if served and model.startswith(f"{served}:"):
        adapter = model[len(served) + 1 :]
    else:
        adapter = model.split(":", 1)[1]
    return adapter.strip() or explicit


def generate_body(
    request: EngineRequest,
    options: GenerateOptions,
    *,
    rid: str,
    require_reasoning: bool,
    sampling: Mapping[str, Any] | None = None,
    session_hint: str | None = None,
    input_ids: IdArray | None = None,
    session_params: Mapping[str, Any] | None = None,
    dp_rank: int | None = None,
    model: str | None = None,
    served_model: str | None = None,
) -> bytes:
    """The ``/generate`` request for one turn (Untranslatable: refused).
    `sampling` is `sampling_params`' result when the caller has it already;
    delta-sync sends `input_ids` (the new ids only) and `session_params`;
    `model` (the name the chat route would be sent) may name a LoRA adapter
    of `served_model`."""
    body: dict[str, Any] = {
        "input_ids": request.input_ids if input_ids is None else input_ids,
        "sampling_params": sampling_params(request, options) if sampling is None else sampling,
        "rid": rid,
        "return_logprob": True,
        "logprob_start_len": -1,
        # The chat route always asks for the tokens' text (its logprobs carry it).
        "return_text_in_logprobs": True,
        # reasoning_tokens are counted (and grammars start) by this (serving_chat).
        "require_reasoning": require_reasoning,
        "stream": False,
    }
    if request.priority is not None:
        body["priority"] = request.priority
    if request.experts_from is not None:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = request.experts_from
    if session_hint is not None:
        body["session_id"] = session_hint
    if session_params is not None:
        body["session_params"] = session_params
    if dp_rank is not None:
        body["routed_dp_rank"] = dp_rank
    lora = lora_adapter(model, served_model, request.params.get("lora_path"))
    if lora is not None:
        body["lora_path"] = lora
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


# Model types whose answers SGLang's chat route decodes with special tokens
# (serving_chat._process_messages: is_gpt_oss, is_gemma4).
_KEEPS_SPECIAL_TOKENS: Final = frozenset({"gpt_oss", "gemma4", "gemma4_unified"})


def model_options(parsers: Parsers, model_dir: str | Path) -> GenerateOptions:
    """The options for the model in `model_dir` (its generation_config and
    config.json, where present)."""
    model_type = None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text("utf-8"))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        config = None
    if isinstance(config, dict):
        model_type = config.get("model_type")
    try:
        defaults = read_sampling_defaults(model_dir)
    except NotADirectoryError:
        defaults = {}
    if not (Path(model_dir) / "generation_config.json").is_file():
        # Not silent: unset sampling parameters may differ from the chat route's.
        logger.warning(
            "sglang-generate: no generation_config.json in %s; requests that leave "
            "temperature, top_p, top_k, min_p or repetition_penalty unset are sent OpenAI's "
            "defaults, where SGLang's chat route would use the model's (pass --tokenizer "
            "as the model's directory; docs/engines.md)",
            model_dir,
        )
    return GenerateOptions(
        parsers, defaults, keeps_special_tokens=model_type in _KEEPS_SPECIAL_TOKENS
    )
