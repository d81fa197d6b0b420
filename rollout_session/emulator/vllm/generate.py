"""What vLLM 0.33.0 checks in a ``POST /inference/v1/generate`` body, for the emulator.

A request passes four stages in vLLM, in this order (paths under ``vllm/``;
TP = ``entrypoints/scale_out/token_in_token_out/protocol.py``, TS = its
``serving.py``, SP = ``sampling_params.py``):

1. FastAPI: ``validate_json_request`` (``entrypoints/serve/utils/api_utils.py``)
   wants ``Content-Type: application/json``, then pydantic parses the body
   into TP ``GenerateRequest``: here the pydantic models of `token_protocol`
   and `sampling` (``SamplingParams``' own ``VLLMValidationError`` escapes
   pydantic as a 400 ``BadRequestError``); a pydantic error is the 400
   ``"Bad Request"`` of ``handlers/validation.py`` (`errors.pydantic_error`).
2. TS ``ServingTokens.serve_tokens``: the model name (404), derender's
   refusals (``stream``, a parser without ``parse_context``, a named
   ``tool_choice`` not in ``tools``), then the ``max_tokens`` default
   (``get_max_tokens``, whose ``ValueError`` is a 400 too).
3. The engine's input checks (``v1/engine/input_processor.py``
   ``process_inputs``): ``SamplingParams.verify`` (``--max-logprobs`` 20,
   out-of-vocab ``logit_bias``/``stop_token_ids``, structured outputs),
   the prompt length, out-of-vocab prompt ids,
   ``routed_experts_prompt_start``, ``min_tokens`` against an unset
   ``max_tokens``.
4. The emulator's own refusals: what vLLM accepts but the emulator does not
   model (streaming, ``n`` > 1, top logprobs and top prompt logprobs,
   grammars other than a JSON schema or ``json_object``, ...): a 400
   ``BadRequestError`` saying so, never a silent approximation.

`check_request` runs them all and returns the request the emulator serves
(`GenerateRequest`, with the `ParseContext` the derenderer reads), or
raises `VllmError` (its ``reply()`` is vLLM's error body:
``entrypoints/serve/engine/protocol.py`` ``ErrorResponse``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from pydantic import ValidationError

from rollout_session.emulator.vllm import token_protocol
from rollout_session.emulator.vllm.errors import (
    VllmError,
    json_body,
    not_modelled,
    pydantic_error,
    require_json,
    validation_error,
)
from rollout_session.emulator.vllm.names import VLLM_MAX_LOGPROBS
from rollout_session.emulator.vllm.sampling import Sampling
from rollout_session.emulator.vllm.tag import read_tag

__all__ = ["GenerateRequest", "ParseContext", "VllmServer", "check_request"]


@dataclass(frozen=True)
class VllmServer:
    """What the served vLLM was started with, as far as the checks read it."""

    model_name: str  # --served-model-name (one alias)
    context_length: int  # max_model_len
    vocab_size: int  # model_config.get_vocab_size()
    tool_call_parser: str | None
    reasoning_parser: str | None
    # get_diff_sampling_param (--generation-config, --override-generation-config:
    # `generation_config`): the defaults the chat route and /render fall back
    # to, and the max_tokens /inference/v1/generate falls back to.
    sampling_defaults: Mapping[str, Any] = dataclass_field(default_factory=dict)
    # `override_max_tokens`: a folder's or the override's max_new_tokens, a
    # cap on render's max_tokens and on generate's default one.
    max_tokens_cap: int | None = None

    @property
    def has_parser(self) -> bool:
        """``OnlineDerenderer.parser is not None``: a tool parser (with
        --enable-auto-tool-choice) or a reasoning parser."""
        return self.tool_call_parser is not None or self.reasoning_parser is not None


@dataclass(frozen=True)
class ParseContext:
    """TP ``ParseContext``: the chat request the derenderer's parser reads."""

    tools: tuple[dict[str, Any], ...] | None
    tool_choice: str | None  # "none" | "auto" | "required" | None; a named choice: `named`
    named: str | None
    parallel_tool_calls: bool | None
    include_reasoning: bool
    chat_template_kwargs: dict[str, Any]
    history_tool_call_cnt: int

    @property
    def forced(self) -> bool:
        """``_forces_tool_calls``: "required" or a named function."""
        return self.named is not None or self.tool_choice == "required"

    def tool_names(self) -> list[str]:
        return [str(t["function"]["name"]) for t in self.tools or ()]


@dataclass(frozen=True)
class GenerateRequest:
    """A ``GenerateRequest`` that passed vLLM's checks and the emulator's."""

    request_id: str  # the body's (the engine id adds the prefix and X-Request-Id)
    token_ids: list[int]
    output_mode: str
    return_token_ids: bool
    # The request's parse_context (read for the tool constraint in any mode).
    parse_context: ParseContext | None
    # What the derenderer parses with: the parse_context in derender mode on
    # a server with a parser; None otherwise (the text is the content).
    derender_context: ParseContext | None
    sampling: Sampling
    # The resolved max_tokens: the generation budget.
    max_tokens: int


def check_request(raw: bytes, content_type: str, server: VllmServer) -> GenerateRequest:
    """Every check of the four stages (module docstring), in vLLM's order."""
    require_json(content_type)
    body = json_body(raw)
    fields = _parse_body(body)
    derender_context, budget = _serve_checks(fields, server)
    _emulator_refusals(fields, server)
    return GenerateRequest(
        request_id=fields.request_id,
        token_ids=fields.token_ids,
        output_mode=fields.output_mode,
        return_token_ids=fields.return_token_ids,
        parse_context=fields.parse_context,
        derender_context=derender_context,
        sampling=fields.sampling,
        max_tokens=budget,
    )


@dataclass
class _Fields:
    """The body after stage 1."""

    request_id: str
    token_ids: list[int]
    sampling: Sampling
    provided: frozenset[str]  # the keys of the raw sampling_params object
    model: str | None
    output_mode: str
    parse_context: ParseContext | None
    stream: bool
    return_token_ids: bool
    # Top-level fields set that the emulator does not model: (field, what).
    unmodelled: tuple[tuple[str, str], ...]


def _parse_body(body: Any) -> _Fields:
    """Stage 1: pydantic's parse of TP ``GenerateRequest`` (`token_protocol`)."""
    try:
        request = token_protocol.GENERATE_BODY(body)
    except ValidationError as exc:
        raise pydantic_error(exc) from None
    context = request.parse_context
    unmodelled = tuple(
        (name, what)
        for name, value, what in (
            ("features", request.features, "multimodal input (features): it serves a text model"),
            (
                "content_parts",
                request.content_parts,
                "multimodal input (content_parts): it serves a text model",
            ),
            (
                "kv_transfer_params",
                request.kv_transfer_params,
                "disaggregated serving (kv_transfer_params)",
            ),
            (
                "ec_transfer_params",
                request.ec_transfer_params,
                "disaggregated serving (ec_transfer_params)",
            ),
            ("cache_salt", request.cache_salt, "cache_salt (its prefix cache is not salted)"),
        )
        if value
    )
    raw_sampling = body["sampling_params"]
    return _Fields(
        request_id=request.request_id,
        token_ids=request.token_ids,
        sampling=request.sampling_params,
        provided=frozenset(raw_sampling) if isinstance(raw_sampling, dict) else frozenset(),
        model=request.model,
        output_mode=request.output_mode,
        parse_context=None if context is None else _parse_context(context, body["parse_context"]),
        stream=bool(request.stream),
        return_token_ids=bool(request.return_token_ids),
        unmodelled=unmodelled,
    )


def _parse_context(context: token_protocol.ParseContext, raw: dict[str, Any]) -> ParseContext:
    """The validated ``ParseContext``; its tools as sent (the parsers read them)."""
    choice = context.tool_choice
    named = None if isinstance(choice, str) or choice is None else choice.function.name
    return ParseContext(
        tools=None if context.tools is None else tuple(raw["tools"]),
        tool_choice=choice if isinstance(choice, str) else None,
        named=named,
        parallel_tool_calls=context.parallel_tool_calls,
        include_reasoning=context.include_reasoning,
        chat_template_kwargs=dict(context.chat_template_kwargs),
        history_tool_call_cnt=context.history_tool_call_cnt,
    )


# -- stages 2 and 3 ------------------------------------------------------------


def _serve_checks(f: _Fields, server: VllmServer) -> tuple[ParseContext | None, int]:
    """TS ``serve_tokens`` then the engine's input checks; returns the parse
    context the derenderer reads (None: no parser, or not derender) and the
    resolved ``max_tokens``."""
    if f.model and f.model != server.model_name:  # BaseServing._check_model
        raise VllmError(
            f"The model `{f.model}` does not exist. Valid aliases: {server.model_name}.",
            type_="NotFoundError",
            code=404,
            param="model",
        )
    context: ParseContext | None = None
    if f.output_mode == "derender":
        if f.stream:
            raise VllmError("output_mode='derender' does not support stream=true.")
        if server.has_parser:
            if f.parse_context is None:
                raise VllmError(
                    "output_mode='derender' requires parse_context on a server with a tool or "
                    "reasoning parser. Use the one returned by /render."
                )
            named = f.parse_context.named
            if named is not None and named not in f.parse_context.tool_names():
                raise validation_error(
                    "The tool specified in `tool_choice` does not match any of the specified "
                    "`tools`",
                    "tool_choice",
                )
            context = f.parse_context
    prompt_len = len(f.token_ids)
    s = f.sampling
    context_length = server.context_length
    max_tokens = s.max_tokens
    if "max_tokens" not in f.provided:
        # get_max_tokens (entrypoints/serve/utils/api_utils.py): a ValueError.
        if context_length < prompt_len:
            raise VllmError(
                f"Input length ({prompt_len}) exceeds model's maximum context length "
                f"({context_length})."
            )
        fallback = server.sampling_defaults.get("max_tokens")
        max_tokens = min(
            v
            for v in (context_length - prompt_len, fallback, server.max_tokens_cap)
            if v is not None
        )
    _engine_checks(f, server)
    if max_tokens is None:  # input_processor: unset max_tokens runs to the context
        max_tokens = context_length - prompt_len
        if s.min_tokens > max_tokens:
            raise validation_error(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                f"got {s.min_tokens}."
            )
    # An explicit max_tokens over the room is not refused: the scheduler stops
    # the request at the context (v1/core/sched/utils.py check_stop: "length").
    return context, min(max_tokens, context_length - prompt_len)


def _engine_checks(f: _Fields, server: VllmServer) -> None:
    """``InputProcessor.process_inputs``: ``SamplingParams.verify``, then the
    prompt (``_validate_prompt_len``, ``Renderer.validate_token_ids``), then
    ``routed_experts_prompt_start``."""
    s = f.sampling
    vocab = server.vocab_size
    for name, count in (("sample", s.logprobs), ("prompt", s.prompt_logprobs)):
        if count:  # `if num_logprobs := self.logprobs`: 0 and None pass
            wanted = vocab if count == -1 else count
            if wanted > VLLM_MAX_LOGPROBS:
                raise validation_error(
                    f"Requested {name} logprobs of {wanted}, which is greater than max "
                    f"allowed: {VLLM_MAX_LOGPROBS}",
                    "logprobs" if name == "sample" else "prompt_logprobs",
                    wanted,
                )
    for name, ids in (
        ("logit_bias", list(s.logit_bias or ())),
        ("stop_token_ids", list(s.stop_token_ids)),
    ):
        invalid = [t for t in ids if t < 0 or t >= vocab]
        if invalid:
            raise validation_error(
                f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab}",
                name,
                invalid,
            )
    if s.constraint is not None:
        kind, value = s.constraint
        if kind == "choice" and not value:
            raise validation_error(f"Choice '{value}' cannot be an empty list")
        if kind in ("grammar", "json") and isinstance(value, str) and not value.strip():
            raise validation_error(f"structured_outputs.{kind} cannot be an empty string")
        if kind == "json_object" and value is False:
            raise validation_error(
                "structured_outputs.json_object must be True if set; omit structured_outputs "
                "to disable structured outputs"
            )
    prompt_len = len(f.token_ids)
    context_length = server.context_length
    if prompt_len > context_length:
        raise validation_error(
            f"The decoder prompt (length {prompt_len}) is longer than the maximum model length "
            f"of {context_length}. Make sure that `max_model_len` is no smaller than the number "
            "of text tokens."
        )
    if prompt_len == context_length:
        raise validation_error(
            f"The decoder prompt (length {prompt_len}) plus the number of requested output "
            "tokens (at least 1) is longer than the maximum model length of "
            f"{context_length}. Make sure that `max_model_len` is no smaller than the number "
            "of text tokens (prompt + requested output tokens)."
        )
    top = max(f.token_ids)
    if top > vocab - 1:
        raise validation_error(f"Token id {top} is out of vocabulary")
    start = s.routed_experts_prompt_start
    if not 0 <= start <= prompt_len:
        raise validation_error(
            f"routed_experts_prompt_start must be between 0 and the prompt length "
            f"({prompt_len}), inclusive.",
            "routed_experts_prompt_start",
            start,
        )


# -- stage 4 -----------------------------------------------------------------


def _emulator_refusals(f: _Fields, server: VllmServer) -> None:
    """What vLLM serves and the emulator does not model (after every vLLM check)."""
    s = f.sampling
    if f.stream:
        raise VllmError("the emulator does not stream: send stream: false", param="stream")
    for name, what in f.unmodelled:
        raise not_modelled(what, name)
    if s.n != 1:
        raise not_modelled("n > 1: it samples one sequence (sampling_params.n must be 1)", "n")
    if s.logprobs not in (None, 0):
        raise not_modelled(
            "top logprobs: it has only the sampled token's (sampling_params.logprobs must be "
            "null or 0)",
            "logprobs",
        )
    if s.prompt_logprobs not in (None, 0):
        raise not_modelled(
            "top prompt logprobs: it has only each prompt token's own "
            "(sampling_params.prompt_logprobs must be null or 0)",
            "prompt_logprobs",
        )
    if s.ignore_eos:
        raise not_modelled(
            "ignore_eos: its model always ends its answer (sampling_params.ignore_eos)",
            "ignore_eos",
        )
    for name in s.unmodelled:
        raise not_modelled(f"sampling_params.{name}", name)
    if s.constraint is not None and s.constraint[0] == "structural_tag":
        _check_tag(s.constraint[1], server)
    elif s.constraint is not None and s.constraint[0] not in ("json", "json_object"):
        raise not_modelled(
            f"structured_outputs.{s.constraint[0]} (only json and json_object)",
            "structured_outputs",
        )


def _check_tag(text: Any, server: VllmServer) -> None:
    """A structural tag is served only if the emulator's render route minted
    it for this server's tool parser (`vllm.tag`): xgrammar's are not
    modelled."""
    tag = read_tag(text)
    if tag is None:
        raise not_modelled(
            "structured_outputs.structural_tag (only the tags its "
            "/v1/chat/completions/render mints; xgrammar's are not modelled)",
            "structured_outputs",
        )
    if tag.parser != server.tool_call_parser:
        raise not_modelled(
            f"structured_outputs.structural_tag for tool parser {tag.parser!r} on a server "
            f"whose tool parser is {server.tool_call_parser!r}",
            "structured_outputs",
        )
