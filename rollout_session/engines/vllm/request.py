"""The ``/inference/v1/generate`` request vLLM's chat route would have built.

vLLM 0.33's chat route turns an OpenAI request into sampling parameters with
``ChatCompletionRequest.to_sampling_params`` after its parsers'
``adjust_request`` (entrypoints/openai/chat_completion/serving.py
``_create_chat_completion``); ``/v1/chat/completions/render``
(entrypoints/scale_out/render/serving.py) writes the same into a
``GenerateRequest``. This module does the same from the agent's parsed
request and the prompt ids the session rendered, key by key, and sends every
sampling key explicitly: ``/inference/v1/generate`` applies no model default
but ``max_tokens`` (docs/research/vllm-0.33-generate-request.md §5).

One thing only vLLM's process can build: the tool-call constraint its
parsers' ``adjust_request`` makes (an xgrammar structural tag) for a forced
``tool_choice``, strict tools and the like (`parser_constrains`); the
engine asks the worker's ``/v1/chat/completions/render`` for it
(`render_body`). What the chat route would do that cannot be reproduced is
refused per request with `Untranslatable` (docs/engines.md#vllm lists each
case).
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
from .parsers import VllmParsers

__all__ = [
    "Untranslatable",
    "VllmOptions",
    "generate_body",
    "model_options",
    "parser_constrains",
    "read_sampling_defaults",
    "render_body",
    "sampling_params",
]

logger = logging.getLogger("rollout_session")

# ModelConfig.get_diff_sampling_param's keys (max_new_tokens is max_tokens there).
_MODEL_DEFAULT_KEYS: Final = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
    "skip_special_tokens",
)
# transformers' GenerationConfig defaults: to_diff_dict (try_get_generation_config)
# drops a value equal to one of these, so the model's file cannot set it.
_HF_DEFAULTS: Final[Mapping[str, float | int]] = {
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
}
# ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS.
_DEFAULTS: Final[Mapping[str, float | int]] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
# Request keys whose effect this engine does not reproduce.
_REFUSED: Final[Mapping[str, str]] = {
    "top_logprobs": "top logprobs are not rebuilt into the answer",
    "prompt_logprobs": "prompt logprobs are not part of a trajectory",
    "echo": "echo is not part of a trajectory",
    "use_beam_search": "beam search samples several sequences",
    "truncate_prompt_tokens": "the trajectory's prompt is never truncated",
    "reasoning_effort": "it changes the chat-template kwargs vLLM's parsers read",
    "continue_final_message": "the session renders the prompt; vLLM would continue it",
    "logprob_token_ids": "logprobs of other tokens are not part of a trajectory",
    "vllm_xargs": "extra_args reach vLLM's custom logits processors, not reproduced here",
}


class Untranslatable(Exception):
    """The chat route would do something ``/inference/v1/generate`` cannot
    be made to do; `param` is the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What the translation needs besides the request."""

    parsers: VllmParsers = field(default_factory=VllmParsers)
    # get_diff_sampling_param: the model's generation_config defaults
    # (max_new_tokens under its own name).
    model_defaults: Mapping[str, Any] = field(default_factory=dict)


def read_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """generation_config.json's sampling defaults as vLLM's default
    ``--generation-config auto`` reads them (none when the file is absent)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text("utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    if not isinstance(config, dict):
        raise TypeError(f"{path} is not a JSON object")
    return {
        key: config[key]
        for key in _MODEL_DEFAULT_KEYS
        if config.get(key) is not None and _HF_DEFAULTS.get(key) != config[key]
    }


def effective_default(model_defaults: Mapping[str, Any], key: str) -> Any:
    """What the chat route applies for `key` when a request leaves it unset:
    the model's default, else ``ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS``
    (``skip_special_tokens`` True; ``max_new_tokens`` None: no cap)."""
    if key in model_defaults:
        return model_defaults[key]
    return {"skip_special_tokens": True, "max_new_tokens": None, **_DEFAULTS}.get(key)


def model_options(parsers: VllmParsers, model_dir: str | Path) -> VllmOptions:
    if not (Path(model_dir) / "generation_config.json").is_file():
        # Not silent: vLLM may read defaults from files the server does not see.
        logger.warning(
            "vllm: no generation_config.json in %s; requests that leave sampling parameters "
            "unset are sent vLLM's neutral defaults, as a worker with --generation-config "
            "vllm would use (pass --tokenizer as the model's directory; docs/engines.md#vllm)",
            model_dir,
        )
    return VllmOptions(parsers, read_sampling_defaults(model_dir))


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools and tool_choice after the chat route's validators
    (``ChatCompletionRequest.check_tool_usage``)."""

    tools: list[Mapping[str, Any]] | None
    choice: Any

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> ToolRequest:
        tools = params.get("tools")
        if tools is not None and not tools:
            raise Untranslatable(
                "`tools` must not be an empty array. Either provide at least one tool or "
                "omit the field entirely.",
                "tools",
            )
        choice = params.get("tool_choice")
        if choice is None:
            choice = "auto" if tools else "none"
        if choice != "none" and not tools:
            raise Untranslatable("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if not any((t.get("function") or {}).get("name") == name for t in tools or ()):
                raise Untranslatable(
                    "The tool specified in `tool_choice` does not match any of the "
                    "specified `tools`",
                    "tool_choice",
                )
        return cls(tools, choice)

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def _check_tools(tools: ToolRequest, parsers: VllmParsers) -> None:
    """OnlineRenderer.render_chat's refusal of tools without a tool parser."""
    if not tools.active or parsers.tool is not None:
        return
    if tools.choice == "auto":
        raise Untranslatable(
            '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set",
            "tool_choice",
        )
    raise Untranslatable(
        f"tool_choice={tools.choice!r} requires --tool-call-parser to be set", "tool_choice"
    )


def parser_constrains(params: Mapping[str, Any], parsers: VllmParsers) -> bool:
    """Whether vLLM's parsers build this request's tool-call constraint in
    ``adjust_request`` (a structural tag from xgrammar, or the JSON-array
    schema): a forced ``tool_choice``, a ``strict`` tool, ``parallel_tool_calls``
    false, or any tool request under a FUNCTION-level parser
    (DelegatingParser._apply_structural_tag, resolve_tool_strictness,
    ToolParser.adjust_request). Only vLLM's process can build it: the
    engine asks the worker's ``/v1/chat/completions/render`` for it."""
    tools = ToolRequest.of(params)
    parser = parsers.tool
    if not tools.active or parser is None:
        return False
    strict = any((t.get("function") or {}).get("strict") is True for t in tools.tools or ())
    parallel = params.get("parallel_tool_calls") is not False
    return tools.choice != "auto" or strict or not parallel or parser.function_level


def render_body(request: EngineRequest, model: str | None) -> bytes:
    """The ``/v1/chat/completions/render`` request whose ``structured_outputs``
    is the tool-call constraint vLLM's chat route would sample this turn
    under: what its ``adjust_request`` reads (tools, tool_choice,
    parallel_tool_calls, response_format, structured_outputs, the template
    kwargs) and the conversation it renders. One token is asked for: the
    answer's ``max_tokens`` is not used."""
    params = request.params
    body: dict[str, Any] = {
        key: params[key]
        for key in (
            "messages",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
            "structured_outputs",
        )
        if params.get(key) is not None
    }
    body["chat_template_kwargs"] = dict(request.template_kwargs)
    body["max_tokens"] = 1
    if model is not None:
        body["model"] = model
    return orjson.dumps(body)


def _structured_outputs(params: Mapping[str, Any]) -> dict[str, Any] | None:
    """extract_structured_outputs / structured_outputs_from_response_format."""
    own = params.get("structured_outputs")
    fmt = params.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text"):
        return dict(own) if isinstance(own, dict) else None
    if kind == "json_object":
        override: dict[str, Any] = {"json_object": True}
    elif kind == "json_schema":
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
        if not isinstance(spec, dict):
            raise Untranslatable(
                "When response_format type is 'json_schema', the 'json_schema' field must "
                "be provided.",
                "response_format",
            )
        override = {"json": spec.get("schema")}
    elif kind == "structural_tag":
        raise Untranslatable(
            "response_format structural_tag is re-serialised by vLLM's pydantic model, "
            "not reproduced; use an SGLang engine",
            "response_format",
        )
    else:
        raise Untranslatable(f"response_format type {kind!r} is not one vLLM knows")
    return {**own, **override} if isinstance(own, dict) else override


def _logit_bias(value: Any) -> dict[str, float] | None:
    """SamplingParams.from_optional: integer keys, values clamped to ±100."""
    if not value:
        return None
    out: dict[str, float] = {}
    bad = []
    for key, bias in dict(value).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            bad.append(key)
            continue
        out[str(token)] = min(100.0, max(-100.0, float(bias)))
    if bad:
        raise Untranslatable(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad}",
            "logit_bias",
        )
    return out


def _max_tokens(request: EngineRequest, options: VllmOptions, context: int | None) -> int | None:
    """api_utils.get_max_tokens: the least of the room left, the request's
    limit (else the model's default) and the session cap."""
    params = request.params
    asked = params.get("max_completion_tokens")
    if asked is None:
        asked = params.get("max_tokens")
    if asked is not None and context is not None and asked > context:
        name = "max_completion_tokens" if params.get("max_completion_tokens") else "max_tokens"
        raise Untranslatable(
            f"{name}={asked} cannot be greater than max_model_len={context}. Please request "
            "fewer output tokens.",
            name,
        )
    limit = asked if asked is not None else options.model_defaults.get("max_new_tokens")
    room = None if context is None else context - len(request.input_ids)
    caps = [v for v in (room, limit, request.max_tokens) if v is not None]
    return min(caps) if caps else None


def template_kwargs(request: EngineRequest) -> dict[str, Any]:
    """The effective chat-template kwargs (OnlineRenderer.effective_chat_template_kwargs):
    the request's, under the chat route's own add_generation_prompt and
    continue_final_message."""
    return {
        **request.template_kwargs,
        "add_generation_prompt": True,
        "continue_final_message": False,
    }


def sampling_params(
    request: EngineRequest, options: VllmOptions, context: int | None
) -> dict[str, Any]:
    """`ChatCompletionRequest.to_sampling_params` after `adjust_request`,
    every key explicit (Untranslatable: refused). `context`: the served
    model's max_model_len (None: unknown, no limit derived from it)."""
    params = request.params
    for key, why in _REFUSED.items():
        if params.get(key) not in (None, False, 0, {}, []):
            raise Untranslatable(f"{key}: {why}; use an SGLang engine", key)
    if params.get("n") not in (None, 1):
        raise Untranslatable("n must be 1: a trajectory holds one sample per turn", "n")
    tools = ToolRequest.of(params)
    _check_tools(tools, options.parsers)

    def pick(key: str) -> Any:
        value = params.get(key)
        if value is not None:
            return value
        return options.model_defaults.get(key, _DEFAULTS[key])

    skip_special = params.get("skip_special_tokens")
    if skip_special is None:
        skip_special = options.model_defaults.get("skip_special_tokens", True)
    if options.parsers.keeps_special_tokens(tools.active):
        skip_special = False  # the parsers' adjust_request
    stop = params.get("stop")
    out: dict[str, Any] = {
        "n": 1,
        "temperature": pick("temperature"),
        "top_p": pick("top_p"),
        "top_k": pick("top_k"),
        "min_p": pick("min_p"),
        "repetition_penalty": pick("repetition_penalty"),
        "presence_penalty": pick("presence_penalty"),
        "frequency_penalty": pick("frequency_penalty"),
        "max_tokens": _max_tokens(request, options, context),
        "min_tokens": params.get("min_tokens") or 0,
        "stop": [stop] if isinstance(stop, str) else list(stop or []),
        "stop_token_ids": list(params.get("stop_token_ids") or []),
        "ignore_eos": bool(params.get("ignore_eos", False)),
        "skip_special_tokens": skip_special,
        "spaces_between_special_tokens": params.get("spaces_between_special_tokens", True),
        "include_stop_str_in_output": bool(params.get("include_stop_str_in_output", False)),
        # The sampled token's logprob, nothing more (to_sampling_params: top_logprobs or 0).
        "logprobs": 0,
        "seed": params.get("seed"),
        "structured_outputs": _structured_outputs(params),
    }
    bias = _logit_bias(params.get("logit_bias"))
    if bias is not None:
        out["logit_bias"] = bias
    for key in ("bad_words", "allowed_token_ids", "thinking_token_budget", "repetition_detection"):
        if params.get(key) is not None:
            out[key] = params[key]
    if request.experts_from is not None:
        out["routed_experts_prompt_start"] = request.experts_from
    return out


def parse_context(request: EngineRequest) -> dict[str, Any]:
    """ParseContext as /render writes it: what vLLM's parsers read of the request."""
    params = request.params
    tools = ToolRequest.of(params)
    history = sum(
        len(m.get("tool_calls") or [])
        for m in params.get("messages") or []
        if m.get("role") == "assistant"
    )
    return {
        "tools": tools.tools,
        "tool_choice": tools.choice,
        "parallel_tool_calls": params.get("parallel_tool_calls", True),
        # Always parsed: hiding reasoning also hides token_ids and logprobs
        # (ServingTokens.serve_tokens_full_generator); the reply hides it instead.
        "include_reasoning": True,
        "chat_template_kwargs": template_kwargs(request),
        "history_tool_call_cnt": history,
    }


def generate_body(
    request: EngineRequest,
    options: VllmOptions,
    *,
    request_id: str,
    model: str | None,
    context: int | None,
    sampling: Mapping[str, Any] | None = None,
) -> bytes:
    """The ``/inference/v1/generate`` body for one turn (Untranslatable: refused)."""
    body: dict[str, Any] = {
        "request_id": request_id,
        "token_ids": request.input_ids,
        "output_mode": "derender",
        "stream": False,
        "sampling_params": (
            sampling_params(request, options, context) if sampling is None else sampling
        ),
        "parse_context": parse_context(request),
    }
    if model is not None:
        body["model"] = model
    if options.parsers.reasoning is not None:
        body["reasoning_parser_kwargs"] = {"chat_template_kwargs": template_kwargs(request)}
    if request.params.get("include_reasoning") is False:
        # CP resolve_reasoning_ended: structured outputs constrain from the first token.
        body["reasoning_ended"] = True
    if request.priority is not None:
        body["priority"] = request.priority
    salt = request.params.get("cache_salt")
    if salt is not None:
        body["cache_salt"] = salt
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


# What vLLM's parsers and derender's decoding read of the chat request
# (online_derenderer: the parser's request context; _drop_stop_token).
_DERENDER_KEYS = (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
)


def derender_body(
    first: EngineRequest,
    *,
    request_id: str,
    ids: IdArray,
    finish_reason: str,
    stop_reason: int | str | None,
    model: str | None,
) -> bytes:
    """``POST /v1/chat/completions/derender`` for a completion stitched from
    token-route answers (docs/research/vllm-0.33-derender.md): a tokens-mode
    generate response holding all its ids after the turn's first prompt,
    with the last answer's ending ("tool_calls" is derender mode's rewrite
    of the engine's "stop"), and the turn's own chat request (`first`: its
    original limits and stop conditions)."""
    params = first.params
    chat: dict[str, Any] = {
        key: params[key] for key in _DERENDER_KEYS if params.get(key) is not None
    }
    chat["include_reasoning"] = True  # parse_context's: the reply hides it instead
    chat["chat_template_kwargs"] = template_kwargs(first)
    prompt = first.input_ids
    body: dict[str, Any] = {
        "generate_response": {
            "request_id": request_id,
            "output_mode": "tokens",
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "token_ids": ids,
                    "finish_reason": "stop" if finish_reason == "tool_calls" else finish_reason,
                    "stop_reason": stop_reason,
                    "logprobs": None,
                }
            ],
        },
        "prompt_tokens": len(prompt),
        "prompt_token_ids": prompt,
        "chat_request": chat,
    }
    if model is not None:
        body["model"] = model
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
