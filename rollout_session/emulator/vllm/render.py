"""What vLLM 0.33.0's ``POST /v1/chat/completions/render`` answers, for the emulator.

``entrypoints/scale_out/render/serving.py`` ``ServingRender.render_chat_request``
(RS below; CP = ``entrypoints/openai/chat_completion/protocol.py``, OR =
``renderers/online_renderer.py``, SP = ``sampling_params.py``) turns a chat
request into the ``GenerateRequest`` the chat route would have sampled, in
this order:

1. FastAPI + pydantic parse the body into CP ``ChatCompletionRequest``
   (here the pydantic model of `chat_protocol`): its
   "before" model validators first (pydantic runs them last-defined first:
   ``check_generation_prompt``, ``check_tool_usage``,
   ``check_structured_outputs_count``, ``check_logprobs``,
   ``validate_stream_options``, ``validate_response_format``,
   ``_normalize_messages_before``, ``check_cache_salt_support``), whose
   ``VLLMValidationError`` is a 400 ``BadRequestError``; then the fields
   (pydantic's 400 ``"Bad Request"``).
2. RS: ``_check_model`` (404), beam search refused.
3. OR ``render_chat``: tool_choice without a tool parser, a request chat
   template, per-request multimodal kwargs, ``max_tokens`` over the context
   (``renderers/params.py`` ``TokenizeParams``); the template
   (``renderers/hf.py`` ``safe_apply_chat_template``, ``tokenize=False``),
   then tokenization without special tokens (``build_tok_params``:
   ``add_special_tokens`` is the request's, false by default), the prompt
   length; then the parsers' ``adjust_request`` (``preprocess_chat``):
   ``DelegatingParser._apply_structural_tag`` and the tool parser's JSON
   schema (``parser/abstract_parser.py``, ``tool_parsers/abstract_tool_parser.py``),
   ``skip_special_tokens``.
4. RS: ``get_max_tokens``, ``to_sampling_params`` (``SamplingParams``'
   checks), ``reasoning_ended``, the ``ParseContext``.

The answer is ``GenerateRequest.model_dump()`` (TP
``entrypoints/scale_out/token_in_token_out/protocol.py``; fields in its
declaration order), ``sampling_params`` serialised by
``v1/serial_utils.py`` ``PydanticMsgspecMixin._serialize_msgspec``:
``msgspec.to_builtins`` with ``omit_defaults``, which omits a field whose
value *is* its default object (identity, checked with msgspec 0.22): bools,
``None``, small ints equal to the default go; the floats the chat route
resolves (new objects) stay, as do ``[]`` where the default is ``None``.

The structural tag xgrammar would build is replaced by the emulator's own
(`vllm.tag`). What the emulator does not model is refused (400
``BadRequestError``, "the emulator does not model ..."), after vLLM's checks
that precede rendering.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jinja2
from pydantic import ValidationError

from rollout_session.emulator.vllm.chat_protocol import (
    CHAT_BODY,
    ChatCompletionRequest,
    named_tool,
)
from rollout_session.emulator.vllm.errors import (
    VllmError,
    json_body,
    not_modelled,
    pydantic_error,
    require_json,
    validation_error,
)
from rollout_session.emulator.vllm.generate import VllmServer
from rollout_session.emulator.vllm.names import (
    RENDER_REASONING_PARSERS,
    RENDER_TOOL_PARSERS,
    RenderToolParser,
)
from rollout_session.emulator.vllm.sampling import (
    CONSTRAINTS,
    SAMPLING_DEFAULTS,
    SAMPLING_EPS,
    check_one_constraint,
    post_init,
)
from rollout_session.emulator.vllm.tag import mint_tag

__all__ = [
    "RENDER_PATH",
    "Chat",
    "ChatTemplate",
    "chat_request",
    "generation_sampling_defaults",
    "render_chat",
]

RENDER_PATH: Final = "/v1/chat/completions/render"
# CP ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS.
_DEFAULT_SAMPLING: Final = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
# config/model.py get_diff_sampling_param's keys; transformers'
# GenerationConfig defaults, which to_diff_dict drops.
_GENERATION_KEYS: Final = (
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
_HF_DEFAULTS: Final = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}
# StructuredOutputsParams' public fields (SP), in declaration order.
_NO_STRUCTURED_OUTPUTS: Final[Mapping[str, Any]] = {
    "json": None,
    "regex": None,
    "choice": None,
    "grammar": None,
    "json_object": None,
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
}
# Reasoning markers and turn boundaries of the parsers modelled
# (parser/qwen3.py THINK_*, TOOL_CALL_START, CHATML_TURN_BOUNDARIES;
# parser/glm47_moe.py GLM_TURN_BOUNDARIES).
_THINK: Final = ("<think>", "</think>")
_TOOL_CALL_START: Final = "<tool_call>"
_BOUNDARIES: Final = {
    "qwen3": ("<|im_start|>", "<|im_end|>"),
    "glm": ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
}
_ROLES: Final = ("system", "user", "assistant", "tool")
# A serialised field kept whatever its value (`_sampling_params`).
_ALWAYS: Final = object()
# validate_request_mm_kwargs: what each per-request kwarg could change.
_MM_KWARGS: Final = {"mm_processor_kwargs": "preprocessing", "media_io_kwargs": "media loading"}


def generation_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """``ModelConfig.get_diff_sampling_param`` (``--generation-config auto``):
    ``generation_config.json``'s sampling keys that differ from
    transformers' defaults, ``max_new_tokens`` as ``max_tokens``."""
    try:
        config = json.loads((Path(model_dir) / "generation_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    out = {
        key: config[key]
        for key in _GENERATION_KEYS
        if config.get(key) is not None and _HF_DEFAULTS.get(key) != config[key]
    }
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


class ChatTemplate:
    """The worker's tokenizer and chat template, as vLLM's HF renderer uses them."""

    def __init__(self, tokenizer: Any, chat_template: str) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._vocab: dict[str, int] | None = None

    def render(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> str:
        """``safe_apply_chat_template`` with ``tokenize=False``; a template
        that raises is vLLM's 400 with the template's own reason."""
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                chat_template=self.chat_template,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:
            # safe_apply_chat_template: any failure is a VLLMValidationError
            # carrying the template's reason (_template_error_reason).
            raise VllmError(_template_reason(exc)) from None
        if not isinstance(text, str):
            raise VllmError(f"the chat template returned {type(text).__name__}, not text")
        return text

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_id(self, token: str) -> int | None:
        if self._vocab is None:
            self._vocab = dict(self.tokenizer.get_vocab())
        return self._vocab.get(token)


def _template_reason(exc: BaseException) -> str:
    """``renderers/hf.py`` ``_template_error_reason``: the first jinja error
    in the cause chain, else the exception's text."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


# -- 1. the body -------------------------------------------------------------


def _merge(
    defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``renderers/params.py`` ``merge_kwargs``: overrides win, but not with
    ``None`` or ``"auto"``."""
    return {**(defaults or {})} | {
        k: v for k, v in (overrides or {}).items() if v is not None and v != "auto"
    }


# Fields the emulator does not model: (field, set?) -> what it would change.
_UNMODELLED: Final[Sequence[tuple[str, Callable[[Any], bool], str]]] = (
    ("reasoning_effort", lambda v: v is not None, "reasoning_effort (template kwargs)"),
    ("thinking_token_budget", lambda v: v is not None, "thinking_token_budget"),
    ("watermarking", bool, "watermarking"),
    ("truncate_prompt_tokens", lambda v: v is not None, "prompt truncation"),
    ("truncation_side", lambda v: v is not None, "prompt truncation"),
    ("prompt_logprobs", lambda v: v is not None, "prompt logprobs"),
    ("logprob_token_ids", bool, "logprob_token_ids"),
    ("allowed_token_ids", lambda v: v is not None, "allowed_token_ids"),
    ("bad_words", bool, "bad_words"),
    ("echo", bool, "echo"),
    ("continue_final_message", bool, "continue_final_message"),
    ("documents", lambda v: v is not None, "documents"),
    ("return_token_offsets", bool, "token offsets (return_token_offsets)"),
    ("kv_transfer_params", bool, "disaggregated serving (kv_transfer_params)"),
    ("ec_transfer_params", bool, "disaggregated serving (ec_transfer_params)"),
    ("vllm_xargs", bool, "vllm_xargs (extra_args)"),
    ("repetition_detection", lambda v: v is not None, "repetition_detection"),
)


@dataclass
class Chat:
    """The request after stage 1: its messages and its fields with
    pydantic's defaults (`chat_protocol.ChatCompletionRequest.fields`)."""

    messages: list[Any]
    f: dict[str, Any]

    @property
    def named(self) -> str | None:
        return named_tool(self.f["tool_choice"])

    @property
    def tool_choice(self) -> Any:
        return self.f["tool_choice"]


def chat_request(request: ChatCompletionRequest) -> Chat:
    """The validated request as stage 2 on reads it."""
    return Chat(list(request.messages), request.fields())


def _parse(body: Any) -> Chat:
    """Stage 1: CP's "before" validators, then its fields (pydantic)."""
    try:
        return chat_request(CHAT_BODY(body))
    except ValidationError as exc:
        raise pydantic_error(exc) from None


# -- 3. rendering ----------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """A message's content as vLLM's "string" content format renders it: a
    string, null as "", text parts joined with newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                raise not_modelled(f"content parts other than text ({where})", "messages")
        return "\n".join(texts)
    raise not_modelled(f"message content that is not text ({where})", "messages")


def _arguments(value: Any) -> dict[str, Any]:
    """``_postprocess_messages``: a tool call's arguments as the dict
    templates expect (an unreadable or non-object string is ``{}``)."""
    if not value:
        return {}
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
    return parsed if isinstance(parsed, dict) else {}


def _conversation(messages: list[Any]) -> list[dict[str, Any]]:
    """``renderers/chat_utils/chat_message.py`` ``parse_chat_messages`` for
    text messages: role, content, an assistant's tool calls (arguments as
    dicts) and reasoning (also as ``reasoning_content``), a tool message's
    ``tool_call_id``, ``name``."""
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise not_modelled(
                f"{where}: it renders messages of role {', '.join(_ROLES)}", "messages"
            )
        assert isinstance(message, dict)
        out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise not_modelled(f"{where}: tool_calls that are not a list", "messages")
                if calls:
                    out["tool_calls"] = [_tool_call(call) for call in calls]
            reasoning = message.get("reasoning")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise not_modelled(f"{where}: reasoning that is not text", "messages")
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        conversation.append(out)
    return conversation


def _tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise validation_error("assistant tool_calls entries must be objects.", "tool_calls")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise validation_error(
            "chat completions only support assistant tool_calls of type 'function'.",
            "tool_calls",
        )
    out = copy.deepcopy(call)
    out["function"]["arguments"] = _arguments(function.get("arguments"))
    return out


# -- 3b. adjust_request ------------------------------------------------------------


def _response_format(value: Any) -> dict[str, Any] | None:
    """The ``response_format`` shapes modelled: ``text``, ``json_object``,
    ``json_schema`` with ``{name, schema}``."""
    if value is None:
        return None
    if isinstance(value, dict):
        kind = value.get("type")
        if kind in ("text", "json_object"):
            return {"type": kind}
        spec = value.get("json_schema")
        if (
            kind == "json_schema"
            and isinstance(spec, dict)
            and isinstance(spec.get("name"), str)
            and (spec.get("schema") is None or isinstance(spec["schema"], dict))
        ):
            return {"type": kind, "schema": spec.get("schema")}
        if kind == "structural_tag":
            raise not_modelled("response_format structural_tag", "response_format")
    raise not_modelled(
        "a response_format other than text, json_object or json_schema {name, schema}",
        "response_format",
    )


def _extract(
    structured: Mapping[str, Any] | None, fmt: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """``structured_outputs_from_response_format``: the response format
    overrides the request's structured outputs (``dataclasses.replace``)."""
    if fmt is None or fmt["type"] == "text":
        return None if structured is None else dict(structured)
    override = {"json_object": True} if fmt["type"] == "json_object" else {"json": fmt["schema"]}
    params = {**(structured or _NO_STRUCTURED_OUTPUTS), **override}
    check_one_constraint(params)
    return params


def _tool_params(tool: Mapping[str, Any]) -> dict[str, Any]:
    """``_params_or_empty_object``."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def _json_schema(chat: Chat, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``tool_parsers/utils.py`` ``get_json_schema_from_tools`` for a chat
    request: a named function's parameters, or the "required" array (its
    tools' ``$defs`` moved to the top: popped from the request's tools)."""
    named = chat.named
    if named is not None:
        tool = next(t for t in tools if t["function"]["name"] == named)  # checked in stage 1
        return _tool_params(tool)
    if chat.tool_choice != "required":
        return None
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _tool_params(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if chat.f["parallel_tool_calls"] is False:
        schema["maxItems"] = 1
    defs: dict[str, Any] = {}
    for tool in tools:
        params = tool["function"].get("parameters")
        if params is None:
            continue
        found = params.pop("$defs", {})
        name = tool["function"]["name"]
        if not isinstance(found, dict):
            raise validation_error(
                f"`$defs` in the parameters of tool '{name}' must be an object, got "
                f"{type(found).__name__}.",
                "tools",
            )
        for key, value in found.items():
            if key in defs and defs[key] != value:
                raise validation_error(
                    f"Tool definition '{key}' has multiple schemas, which is not supported.",
                    "tools",
                )
            defs[key] = value
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class _Adjusted:
    """What ``adjust_request`` left in the request."""

    structured_outputs: dict[str, Any] | None
    response_format: dict[str, Any] | None
    skip_special_tokens: bool | None


def _adjust(chat: Chat, server: VllmServer, structured: Any, fmt: Any) -> _Adjusted:
    """OR ``preprocess_chat``'s tail: the parsers' ``adjust_request``
    (``DelegatingParser.adjust_request``: the reasoning parser's, then
    ``_apply_structural_tag``, then the tool parser's)."""
    out = _Adjusted(structured, fmt, chat.f["skip_special_tokens"])
    tool_name, reasoning_name = server.tool_call_parser, server.reasoning_parser
    choice = chat.tool_choice
    if (tool_name is None and reasoning_name is None) or (
        reasoning_name is None and choice == "none"
    ):
        return out
    if reasoning_name is not None and RENDER_REASONING_PARSERS[reasoning_name].engine:
        out.skip_special_tokens = False
    if tool_name is None:
        return out
    parser = RENDER_TOOL_PARSERS[tool_name]
    tools = chat.f["tools"]
    if tools and (choice in ("auto", "required") or chat.named is not None):
        tag = _structural_tag(chat, tool_name, parser, tools, _extract(structured, fmt))
        if tag is not None:
            out.structured_outputs = {**_NO_STRUCTURED_OUTPUTS, "structural_tag": tag}
            out.response_format = None
    # The tool parser's adjust_request.
    if (
        tools
        and parser.json_schema
        and not (
            out.structured_outputs and out.structured_outputs.get("structural_tag") is not None
        )
    ):
        schema = _json_schema(chat, tools)
        if schema is not None:
            out.structured_outputs = {**_NO_STRUCTURED_OUTPUTS, "json": schema}
            out.response_format = None
    if parser.skip_special == "always" or (
        parser.skip_special == "with_tools" and tools and choice != "none"
    ):
        out.skip_special_tokens = False
    return out


def _structural_tag(
    chat: Chat,
    parser_name: str,
    parser: RenderToolParser,
    tools: list[dict[str, Any]],
    structured: dict[str, Any] | None,
) -> str | None:
    """``DelegatingParser._apply_structural_tag`` with the emulator's tag:
    whether ``resolve_tool_strictness`` keeps the tools (not for "auto" at
    strict level AUTO without a strict tool; ``parallel_tool_calls: false``
    raises the level to FUNCTION unless "auto" has a structured output;
    glm45/glm47 default to FUNCTION), and "auto"'s structured output folded
    in (``OrFormat``)."""
    if not parser.structural_tag:
        return None
    is_auto = chat.tool_choice == "auto"
    single = chat.f["parallel_tool_calls"] is False
    function_level = parser.function_level or (single and not (is_auto and structured is not None))
    strict = [t["function"]["name"] for t in tools if t["function"].get("strict") is True]
    if is_auto and not function_level and not strict:
        return None
    fmt: dict[str, Any] | None = None
    if is_auto and structured is not None:
        fmt = _tag_format(structured)
    return mint_tag(
        parser=parser_name,
        tools=[t["function"]["name"] for t in tools],
        tool_choice=None if chat.named is not None else str(chat.tool_choice),
        named=chat.named,
        strict=strict,
        stop_after_first=single,
        response_format=fmt,
    )


def _tag_format(structured: Mapping[str, Any]) -> dict[str, Any]:
    """``structured_outputs_to_format`` for the outputs modelled."""
    if structured.get("json_object"):
        return {"json_object": True}
    schema = structured.get("json")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise VllmError(f"structured_outputs.json is not JSON: {exc}") from None
    return {"json": schema}


# -- 4. the answer -----------------------------------------------------------------


def _reasoning_ended(
    chat: Chat,
    server: VllmServer,
    kwargs: Mapping[str, Any],
    ids: Sequence[int],
    template: ChatTemplate,
) -> bool | None:
    """CP ``resolve_reasoning_ended``: True without ``include_reasoning``;
    None without a reasoning parser; else the parser's ``is_reasoning_end``
    over the prompt ids (`vllm.names.RenderReasoningParser`)."""
    if not chat.f["include_reasoning"]:
        return True
    name = server.reasoning_parser
    if name is None:
        return None
    reads = RENDER_REASONING_PARSERS[name].reads
    start, end = (template.token_id(t) for t in _THINK)
    if reads == "think_if_thinking":
        if not (bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))):
            return True  # IdentityReasoningParser
        reads = "think"
    if reads == "think":  # BaseThinkingReasoningParser.is_reasoning_end
        for token in reversed(ids):
            if token == start:
                return False
            if token == end:
                return True
        return False
    if reads == "qwen3":  # Qwen3Parser: thinking unless enable_thinking is off
        thinking = bool(kwargs.get("enable_thinking", True))
    else:  # Glm47MoeParser
        flags = (kwargs.get("thinking"), kwargs.get("enable_thinking"))
        if False in flags and _always_thinks(template.chat_template):
            flags = (None, None)
        thinking = flags == (None, None) or bool(flags[0]) or bool(flags[1])
    if not thinking:  # not waiting for reasoning: ended
        return True
    ends = {template.token_id(_THINK[1]), template.token_id(_TOOL_CALL_START)} - {None}
    bounds = {template.token_id(t) for t in _BOUNDARIES[reads]} - {None}
    for token in reversed(ids):  # ParserEngine.is_reasoning_end
        if token in ends:
            return True
        if token == start or token in bounds:
            return False
    return False


def _always_thinks(chat_template: str) -> bool:
    """``parser/glm47_moe.py`` ``_glm53_always_thinks``."""
    return (
        "[gMASK]<sop>" in chat_template
        and "Reasoning Effort:" in chat_template
        and "enable_thinking" not in chat_template
        and "<tool_call>" in chat_template
        and "<arg_key>" in chat_template
        and "<arg_value>" in chat_template
    )


def _sampling_params(
    chat: Chat,
    server: VllmServer,
    adjusted: _Adjusted,
    structured: dict[str, Any] | None,
    max_tokens: int,
) -> dict[str, Any]:
    """CP ``to_sampling_params`` → ``SamplingParams.from_optional`` →
    ``_post_init__``/``_verify_args`` (`generate.post_init`'s checks),
    serialised as msgspec's ``omit_defaults`` does (module docstring)."""
    f = chat.f
    defaults = server.sampling_defaults
    resolved = {
        name: float(f[name]) if f[name] is not None else defaults.get(name, default)
        for name, default in _DEFAULT_SAMPLING.items()
    }
    resolved["top_k"] = f["top_k"] if f["top_k"] is not None else defaults.get("top_k", 0)
    skip = adjusted.skip_special_tokens
    if skip is None:
        skip = defaults.get("skip_special_tokens", True)
    logit_bias = None
    if f["logit_bias"] is not None:
        invalid = []
        logit_bias = {}
        for key, bias in f["logit_bias"].items():
            try:
                logit_bias[int(key)] = min(100.0, max(-100.0, float(bias)))
            except ValueError:
                invalid.append(key)
        if invalid:
            raise validation_error(
                f"logit_bias contains key(s) that cannot be converted to integer token IDs: "
                f"{invalid!r}",
                "logit_bias",
                invalid,
            )
    n = 1 if f["n"] is None else f["n"]
    logprobs = f["top_logprobs"] if f["logprobs"] else None
    p: dict[str, Any] = dict(SAMPLING_DEFAULTS)
    p.update(
        resolved,
        n=n,
        seed=f["seed"],
        stop=f["stop"],
        stop_token_ids=f["stop_token_ids"],
        ignore_eos=f["ignore_eos"],
        max_tokens=max_tokens,
        min_tokens=f["min_tokens"],
        logprobs=logprobs,
        skip_special_tokens=skip,
        include_stop_str_in_output=f["include_stop_str_in_output"],
        stream_interval=f["stream_interval"],
        structured_outputs=structured,
        logit_bias=logit_bias,
        routed_experts_prompt_start=f["routed_experts_prompt_start"],
    )
    sampling = post_init(p)  # raises vLLM's refusals
    temperature = sampling.temperature
    top_p, top_k, min_p = float(resolved["top_p"]), resolved["top_k"], float(resolved["min_p"])
    if temperature < SAMPLING_EPS:
        top_p, top_k, min_p = 1.0, 0, 0.0
    stop = list(sampling.stop)
    include_stop = f["include_stop_str_in_output"]
    buffer = max(len(s) for s in stop) - 1 if stop and not include_stop else 0
    # (field, value, omitted when equal to this default); the floats the
    # chat route resolves are never the default object: always kept.
    always = _ALWAYS
    fields: list[tuple[str, Any, Any]] = [
        ("n", n, 1),
        ("presence_penalty", float(resolved["presence_penalty"]), always),
        ("frequency_penalty", float(resolved["frequency_penalty"]), always),
        ("repetition_penalty", float(resolved["repetition_penalty"]), always),
        ("temperature", float(temperature), always),
        ("top_p", top_p, always),
        ("top_k", top_k, 0),
        ("min_p", min_p, always),
        ("seed", sampling.seed, None),
        ("stop", stop, always),
        ("stop_token_ids", list(sampling.stop_token_ids), always),
        ("ignore_eos", f["ignore_eos"], False),
        ("max_tokens", max_tokens, 16),
        ("min_tokens", f["min_tokens"], 0),
        ("logprobs", logprobs, None),
        ("skip_special_tokens", skip, True),
        ("spaces_between_special_tokens", f["spaces_between_special_tokens"], True),
        ("include_stop_str_in_output", include_stop, False),
        ("output_kind", 1 if f["stream"] else 2, always),  # DELTA / FINAL_ONLY
        ("stream_interval", f["stream_interval"], None),
        ("skip_clone", True, always),
        ("output_text_buffer_length", buffer, 0),
        ("structured_outputs", structured, None),
        (
            "logit_bias",
            None if logit_bias is None else {str(k): v for k, v in logit_bias.items()},
            None,
        ),
        ("bad_words", [], always),
        ("skip_reading_prefix_cache", False, always),
        ("routed_experts_prompt_start", f["routed_experts_prompt_start"], 0),
    ]
    return {
        name: value
        for name, value, default in fields
        if default is always or value != default or type(value) is not type(default)
    }


def _parse_context(
    chat: Chat, kwargs: Mapping[str, Any], tools: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """RS ``_build_parse_context``: TP ``ParseContext.model_dump()``."""
    named = chat.named
    choice = {"function": {"name": named}, "type": "function"} if named else chat.tool_choice
    history = 0
    for message in chat.messages:
        if isinstance(message, dict) and message.get("role") == "assistant":
            calls = message.get("tool_calls")  # parser/utils.py count_tool_calls
            if calls is not None:
                history += 1 if isinstance(calls, str | bytes | dict) else len(calls)
    return {
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": chat.f["parallel_tool_calls"],
        "include_reasoning": chat.f["include_reasoning"],
        "chat_template_kwargs": dict(kwargs),
        "history_tool_call_cnt": history,
    }


def render_chat(
    raw: bytes,
    content_type: str,
    x_request_id: str | None,
    server: VllmServer,
    template: ChatTemplate,
) -> dict[str, Any]:
    """The ``GenerateRequest`` dump vLLM answers, or `VllmError` (its
    ``reply()`` is vLLM's error body), in vLLM's order (module docstring)."""
    require_json(content_type)
    chat = _parse(json_body(raw))
    f = chat.f
    # 2. ServingRender.render_chat_request
    if f["model"] and f["model"] != server.model_name:  # BaseServing._check_model
        raise VllmError(
            f"The model `{f['model']}` does not exist. Valid aliases: {server.model_name}.",
            type_="NotFoundError",
            code=404,
            param="model",
        )
    if f["use_beam_search"]:
        raise VllmError("Beam search is not supported by the render endpoint")
    # 3. OnlineRenderer.render_chat
    choice = chat.tool_choice
    if server.tool_call_parser is None and choice not in (None, "none"):
        if choice == "auto":
            raise VllmError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        what = f'function "{chat.named}"' if chat.named is not None else f'"{choice}"'
        raise VllmError(f"tool_choice={what} requires --tool-call-parser to be set")
    kwargs_in = f["chat_template_kwargs"]
    if f["chat_template"] is not None or (kwargs_in and kwargs_in.get("chat_template") is not None):
        raise VllmError(
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template."
        )
    for name, what in _MM_KWARGS.items():  # validate_request_mm_kwargs
        if f[name]:
            raise validation_error(
                f"Per-request {name} are disabled by default because they can change "
                f"multimodal {what} resource usage. Start the server with "
                "--trust-request-mm-kwargs only when clients are trusted.",
                name,
            )
    limit_name = "max_completion_tokens" if f["max_completion_tokens"] is not None else "max_tokens"
    limit = f[limit_name]
    context = server.context_length
    if limit is not None and limit > context:  # TokenizeParams._post_init__
        raise validation_error(
            f"{limit_name}={limit} cannot be greater than max_model_len={context}. Please "
            "request fewer output tokens.",
            limit_name,
            limit,
        )
    _refuse_unmodelled(chat, server)
    structured_in = f["structured_outputs"]
    fmt = _response_format(f["response_format"])
    # build_chat_params: the effective template kwargs (parse_context's), then
    # with_defaults({tools, tokenize}) for rendering (None and "auto" dropped).
    kwargs = (kwargs_in or {}) | {
        "add_generation_prompt": f["add_generation_prompt"],
        "continue_final_message": f["continue_final_message"],
    }
    tool_dicts = None if f["tools"] is None else copy.deepcopy(f["tools"])
    rendering = _merge(_merge({}, {"tools": tool_dicts, "tokenize": False}), kwargs)
    if rendering.pop("tokenize", False) is not False:
        raise not_modelled("chat_template_kwargs.tokenize", "chat_template_kwargs")
    rendering.pop("return_dict", None)
    render_tools = rendering.pop("tools", None)
    conversation = _conversation(chat.messages)
    text = template.render(conversation, render_tools, rendering)
    ids = template.encode(text, f["add_special_tokens"])
    if len(ids) > context:  # TokenizeParams._token_len_check (encoded to context + 1)
        count = context + 1
        raise validation_error(
            f"This model's maximum context length is {context} tokens. However, your prompt "
            f"contains at least {count} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            count,
        )
    adjusted = _adjust(chat, server, structured_in, fmt)
    # 4. back in render_chat_request
    if not ids:
        raise VllmError("No token_ids rendered")
    fallback = limit if limit is not None else server.sampling_defaults.get("max_tokens")
    max_tokens = min(v for v in (context - len(ids), fallback) if v is not None)
    structured = _extract(adjusted.structured_outputs, adjusted.response_format)
    sampling = _sampling_params(chat, server, adjusted, structured, max_tokens)
    reasoning = None if server.reasoning_parser is None else {"chat_template_kwargs": dict(kwargs)}
    stream = bool(f["stream"])
    return {
        "request_id": f"chatcmpl-{x_request_id if x_request_id is not None else f['request_id']}",
        "token_ids": ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling,
        "model": f["model"],
        "reasoning_ended": _reasoning_ended(chat, server, kwargs, ids, template),
        "reasoning_parser_kwargs": reasoning,
        "return_token_ids": f["return_token_ids"],
        "output_mode": "tokens",
        "parse_context": _parse_context(chat, kwargs, f["tools"]),
        "stream": stream,
        "stream_options": f["stream_options"] if stream else None,
        "cache_salt": f["cache_salt"],
        "priority": f["priority"],
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def _refuse_unmodelled(chat: Chat, server: VllmServer) -> None:
    """What vLLM renders and the emulator does not model."""
    f = chat.f
    for name, is_set, what in _UNMODELLED:
        if is_set(f[name]):
            raise not_modelled(f"{what} on {RENDER_PATH}", name)
    structured = f["structured_outputs"]
    if structured is not None:
        kind = next(name for name in CONSTRAINTS if structured[name] is not None)
        if kind not in ("json", "json_object"):
            raise not_modelled(
                f"structured_outputs.{kind} on {RENDER_PATH} (only json and json_object)",
                "structured_outputs",
            )
    if chat.named is not None and chat.tool_choice.get("type", "function") != "function":
        raise not_modelled("a named tool_choice whose type is not function", "tool_choice")
    # adjust_request runs with a parser unless tool_choice is "none" and no
    # reasoning parser is set (OnlineRenderer.preprocess_chat).
    tool, reasoning = server.tool_call_parser, server.reasoning_parser
    if reasoning is not None and reasoning not in RENDER_REASONING_PARSERS:
        raise not_modelled(
            f"{RENDER_PATH} with --reasoning-parser {reasoning} (its adjust_request and "
            f"is_reasoning_end; modelled: {', '.join(sorted(RENDER_REASONING_PARSERS))})"
        )
    adjusts = reasoning is not None or chat.tool_choice != "none"
    if tool is not None and adjusts and tool not in RENDER_TOOL_PARSERS:
        raise not_modelled(
            f"{RENDER_PATH} with --tool-call-parser {tool} (its adjust_request; modelled: "
            f"{', '.join(sorted(RENDER_TOOL_PARSERS))})"
        )
