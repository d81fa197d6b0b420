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
   (``renderers/hf.py`` ``safe_apply_chat_template``, ``tokenize=False``:
   `hf_renderer`), then tokenization without special tokens
   (``build_tok_params``: ``add_special_tokens`` is the request's, false by
   default), the prompt length; then the parsers' ``adjust_request``
   (``preprocess_chat``: `adjust_request`).
4. RS: ``get_max_tokens``, ``to_sampling_params`` (``SamplingParams``'
   checks: `sampling.post_init`), ``reasoning_ended`` (`reasoning_end`),
   the ``ParseContext``.

The answer is ``GenerateRequest.model_dump()`` (TP
``entrypoints/scale_out/token_in_token_out/protocol.py``; fields in its
declaration order), ``sampling_params`` serialised by
``v1/serial_utils.py`` ``PydanticMsgspecMixin._serialize_msgspec``:
``msgspec.to_builtins`` with ``omit_defaults``, which omits a field whose
value *is* its default object (identity, checked with msgspec 0.22): bools,
``None``, small ints equal to the default go; the floats the chat route
resolves (new objects) stay, as do ``[]`` where the default is ``None``.

The structural tag xgrammar would build is replaced by the emulator's own
(`tag`). What the emulator does not model is refused (400
``BadRequestError``, "the emulator does not model ..."), after vLLM's checks
that precede rendering.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from pydantic import ValidationError

from rollout_session.emulator.vllm.adjust_request import (
    Adjusted,
    adjust,
    extract,
    response_format,
)
from rollout_session.emulator.vllm.chat_protocol import CHAT_BODY, Chat, chat_request
from rollout_session.emulator.vllm.errors import (
    VllmError,
    json_body,
    not_modelled,
    pydantic_error,
    require_json,
    validation_error,
)
from rollout_session.emulator.vllm.generate import VllmServer
from rollout_session.emulator.vllm.hf_renderer import ChatTemplate, conversation
from rollout_session.emulator.vllm.names import RENDER_REASONING_PARSERS, RENDER_TOOL_PARSERS
from rollout_session.emulator.vllm.reasoning_end import reasoning_ended
from rollout_session.emulator.vllm.sampling import (
    CONSTRAINTS,
    SAMPLING_DEFAULTS,
    SAMPLING_EPS,
    post_init,
)

__all__ = ["RENDER_PATH", "render_chat"]

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
# A serialised field kept whatever its value (`_sampling_params`).
_ALWAYS: Final = object()
# validate_request_mm_kwargs: what each per-request kwarg could change.
_MM_KWARGS: Final = {"mm_processor_kwargs": "preprocessing", "media_io_kwargs": "media loading"}


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


def _parse(body: Any) -> Chat:
    """Stage 1: CP's "before" validators, then its fields (pydantic)."""
    try:
        return chat_request(CHAT_BODY(body))
    except ValidationError as exc:
        raise pydantic_error(exc) from None


# -- 4. the answer -----------------------------------------------------------------


def _sampling_params(
    chat: Chat,
    server: VllmServer,
    adjusted: Adjusted,
    structured: dict[str, Any] | None,
    max_tokens: int,
) -> dict[str, Any]:
    """CP ``to_sampling_params`` → ``SamplingParams.from_optional`` →
    ``__post_init__``/``_verify_args`` (`sampling.post_init`),
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
    fmt = response_format(f["response_format"])
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
    messages = conversation(chat.messages)
    text = template.render(messages, render_tools, rendering)
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
    adjusted = adjust(chat, server, structured_in, fmt)
    # 4. back in render_chat_request
    if not ids:
        raise VllmError("No token_ids rendered")
    # get_max_tokens: the request's, else the server default, under the cap.
    fallback = limit if limit is not None else server.sampling_defaults.get("max_tokens")
    candidates = (context - len(ids), fallback, server.max_tokens_cap)
    max_tokens = min(v for v in candidates if v is not None)
    structured = extract(adjusted.structured_outputs, adjusted.response_format)
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
        "reasoning_ended": reasoning_ended(chat, server, kwargs, ids, template),
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
