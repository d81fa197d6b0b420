"""What vLLM 0.33.0 checks in a ``POST /inference/v1/generate`` body, for the emulator.

A request passes four stages in vLLM, in this order (paths under ``vllm/``;
TP = ``entrypoints/scale_out/token_in_token_out/protocol.py``, TS = its
``serving.py``, SP = ``sampling_params.py``):

1. FastAPI: ``validate_json_request`` (``entrypoints/serve/utils/api_utils.py``)
   wants ``Content-Type: application/json``, then pydantic parses the body
   into TP ``GenerateRequest``: field types (lax), ``token_ids`` non-empty and
   non-negative, ``sampling_params`` into ``SamplingParams`` (whose
   ``__post_init__`` / ``_verify_args`` raise ``VLLMValidationError``, which
   pydantic does not wrap: it escapes as a 400 ``BadRequestError``), then the
   model validators (``output_mode`` needs ``detokenize``; unknown
   ``parse_context`` fields in derender mode). A pydantic error is the 400
   ``"Bad Request"`` of ``handlers/validation.py`` (`body_error`).
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

`check_request` runs them all and returns the request the emulator serves,
or raises `VllmError` (its ``reply()`` is vLLM's error body:
``entrypoints/serve/engine/protocol.py`` ``ErrorResponse``). Pydantic's
messages are reproduced for the errors modelled (type, loc, msg, input
summarised as ``_summarize_error_input`` does); the union-branch errors
pydantic adds for ``sampling_params`` are not.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import TYPE_CHECKING, Any, Final

import orjson
from pydantic import ValidationError

from rollout_session.emulator.faults import Reply
from rollout_session.emulator.vllm.names import VLLM_MAX_LOGPROBS
from rollout_session.emulator.vllm.tag import read_tag

if TYPE_CHECKING:
    from rollout_session.emulator.vllm.request_models import ParseContextModel

__all__ = [
    "GenerateRequest",
    "ParseContext",
    "Sampling",
    "VllmError",
    "VllmServer",
    "check_cache_salt",
    "check_one_constraint",
    "check_request",
    "error_body",
    "not_modelled",
    "random_uuid",
]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_OUTPUT_MODES: Final = ("tokens", "text", "derender")
# `entrypoints/generate/base/protocol.py` validate_cache_salt.
_CACHE_SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
# SamplingParams.__post_init__: a temperature in (0, 0.01) is raised to 0.01.
_MAX_TEMP: Final = 1e-2
_SAMPLING_EPS: Final = 1e-5
_VLLM_MAX_N_SEQUENCES: Final = 16384  # envs.py default
# ParseContext's declared fields (TP): any other key is a "newer /render" one.
_PARSE_CONTEXT_FIELDS: Final = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "include_reasoning",
    "chat_template_kwargs",
    "history_tool_call_cnt",
)
# StructuredOutputsParams' constraint fields (SP), in declaration order.
_CONSTRAINTS: Final = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def random_uuid() -> str:
    """`utils/__init__.py` random_uuid: 16 lowercase hex digits."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


# -- errors ------------------------------------------------------------------


def error_body(message: str, type_: str, code: int, param: str | None = None) -> bytes:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


class VllmError(Exception):
    """A refusal in vLLM's shape; the HTTP status is ``code``."""

    def __init__(
        self,
        message: str,
        *,
        type_: str = "BadRequestError",
        code: int = 400,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.type_ = type_
        self.code = code
        self.param = param

    def reply(self) -> Reply:
        return Reply(self.code, error_body(self.message, self.type_, self.code, self.param))


_NO_VALUE: Final = object()


def validation_error(
    message: str, parameter: str | None = None, value: Any = _NO_VALUE
) -> VllmError:
    """``VLLMValidationError`` (``exceptions.py``) through ``create_error_response``:
    400 ``BadRequestError``, ``param`` its parameter, the message with
    ``" (parameter=…, value=…)"`` appended by its ``__str__``."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not _NO_VALUE and value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return VllmError(text, param=parameter)


def not_modelled(what: str, param: str | None = None) -> VllmError:
    """What vLLM would serve and the emulator cannot: refused, never faked."""
    return VllmError(f"the emulator does not model {what}", param=param)


def _summarize(value: Any) -> Any:
    """``handlers/validation.py`` ``_summarize_error_input``."""
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


class _Errors:
    """Pydantic's validation errors, collected in field order, rendered as
    ``validation_exception_handler`` does (400, type ``"Bad Request"``,
    ``param`` the first error's cleaned ``loc``)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(
        self, type_: str, loc: tuple[str | int, ...], msg: str, value: Any, ctx: Any = None
    ) -> None:
        error: dict[str, Any] = {
            "type": type_,
            "loc": ".".join(str(p) for p in loc),
            "msg": msg,
            "input": _summarize(value),
        }
        if ctx is not None:
            error["ctx"] = ctx
        self.items.append(error)

    def value_error(self, loc: tuple[str | int, ...], message: str, value: Any) -> None:
        self.add(
            "value_error", loc, f"Value error, {message}", value, {"error": ValueError(message)}
        )

    def raise_if_any(self) -> None:
        if self.items:
            raise body_error(self.items)


def body_error(errors: list[Any]) -> VllmError:
    """``validation_exception_handler``: ``"N validation error(s):\\n  {…}"``."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    lines = "".join(f"  {e}\n" for e in errors[:10])
    if count > 10:
        lines += f"  ...and {count - 10} more {label}\n"
    first = errors[0]
    param = first["loc"] if isinstance(first, dict) else None
    return VllmError(
        f"{count} validation {label}:\n{lines}".rstrip(), type_="Bad Request", param=param
    )


_INTERNAL_LOC: Final = re.compile(r"[\[\](){}]")
# handlers/validation.py _INTERNAL_LOC_MARKERS: pydantic-core's schema kinds.
_INTERNAL_LOC_MARKERS: Final = frozenset(
    {
        "function-wrap", "function-after", "function-before", "function-plain",
        "json-or-python", "lax-or-strict", "chain", "default", "nullable", "tagged-union",
        "union", "call", "arguments", "is-instance", "is-subclass", "callable", "str", "int",
        "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
        "complex", "none", "nonetype",
    }
)  # fmt: skip


def _clean_loc(loc: tuple[str | int, ...]) -> str:
    """``clean_loc_for_param``: the dotted path without pydantic's branch markers."""
    parts = [
        str(p)
        for p in loc
        if not (_INTERNAL_LOC.search(str(p)) or str(p).lower() in _INTERNAL_LOC_MARKERS)
    ]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def pydantic_error(exc: ValidationError, prefix: tuple[str, ...] = ("body",)) -> VllmError:
    """FastAPI's ``RequestValidationError`` of a pydantic ``ValidationError``
    (``loc`` under ``prefix``) through ``validation_exception_handler``."""
    errors = []
    for error in exc.errors(include_url=False):
        item: dict[str, Any] = {
            "type": error["type"],
            "loc": _clean_loc((*prefix, *error["loc"])),
            "msg": error["msg"],
            "input": _summarize(error["input"]),
        }
        if "ctx" in error:
            item["ctx"] = error["ctx"]
        errors.append(item)
    return body_error(errors)


# -- pydantic's lax coercions ------------------------------------------------


class _Bad:
    """A value that failed validation (its error is recorded)."""


_BAD: Final = _Bad()
Loc = tuple[str | int, ...]


def _int(v: Any, loc: Loc, errs: _Errors) -> int | _Bad:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            errs.add("finite_number", loc, "Input should be a finite number", v)
        elif v.is_integer():
            return int(v)
        else:
            errs.add(
                "int_from_float",
                loc,
                "Input should be a valid integer, got a number with a fractional part",
                v,
            )
        return _BAD
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            errs.add(
                "int_parsing",
                loc,
                "Input should be a valid integer, unable to parse string as an integer",
                v,
            )
            return _BAD
    errs.add("int_type", loc, "Input should be a valid integer", v)
    return _BAD


def _float(v: Any, loc: Loc, errs: _Errors) -> float | _Bad:
    if isinstance(v, bool | int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            errs.add(
                "float_parsing",
                loc,
                "Input should be a valid number, unable to parse string as a number",
                v,
            )
            return _BAD
    errs.add("float_type", loc, "Input should be a valid number", v)
    return _BAD


_TRUE: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE: Final = frozenset({"0", "off", "f", "false", "n", "no"})


def _bool(v: Any, loc: Loc, errs: _Errors) -> bool | _Bad:
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    if isinstance(v, int | float | str):
        errs.add(
            "bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", v
        )
    else:
        errs.add("bool_type", loc, "Input should be a valid boolean", v)
    return _BAD


def _str(v: Any, loc: Loc, errs: _Errors) -> str | _Bad:
    if isinstance(v, str):
        return v
    errs.add("string_type", loc, "Input should be a valid string", v)
    return _BAD


def _dict(v: Any, loc: Loc, errs: _Errors) -> dict[str, Any] | _Bad:
    if isinstance(v, dict):
        return v
    errs.add("dict_type", loc, "Input should be a valid dictionary", v)
    return _BAD


def _list(v: Any, loc: Loc, errs: _Errors) -> list[Any] | _Bad:
    if isinstance(v, list):
        return v
    errs.add("list_type", loc, "Input should be a valid list", v)
    return _BAD


def _list_of(
    item: Callable[[Any, Loc, _Errors], Any],
) -> Callable[[Any, Loc, _Errors], list[Any] | _Bad]:
    def check(v: Any, loc: Loc, errs: _Errors) -> list[Any] | _Bad:
        values = _list(v, loc, errs)
        if isinstance(values, _Bad):
            return _BAD
        before = len(errs.items)
        out = [item(x, (*loc, i), errs) for i, x in enumerate(values)]
        return _BAD if len(errs.items) > before else out

    return check


def _optional(
    check: Callable[[Any, Loc, _Errors], Any],
) -> Callable[[Any, Loc, _Errors], Any]:
    def optional(v: Any, loc: Loc, errs: _Errors) -> Any:
        return None if v is None else check(v, loc, errs)

    return optional


def _anything(v: Any, loc: Loc, errs: _Errors) -> Any:
    return v


def _int_or_str_list(v: Any, loc: Loc, errs: _Errors) -> Any:
    """``str | list[str] | None`` (``stop``)."""
    if v is None or isinstance(v, str):
        return v
    return _list_of(_str)(v, loc, errs)


def _output_kind(v: Any, loc: Loc, errs: _Errors) -> Any:
    """``RequestOutputKind`` (an IntEnum 0, 1, 2); overwritten by serve_tokens anyway."""
    if isinstance(v, int) and not isinstance(v, bool) and v in (0, 1, 2):
        return v
    errs.add("enum", loc, "Input should be 0, 1 or 2", v, {"expected": "0, 1 or 2"})
    return _BAD


# -- the request ---------------------------------------------------------------


@dataclass(frozen=True)
class VllmServer:
    """What the served vLLM was started with, as far as the checks read it."""

    model_name: str  # --served-model-name (one alias)
    context_length: int  # max_model_len
    vocab_size: int  # model_config.get_vocab_size()
    tool_call_parser: str | None
    reasoning_parser: str | None
    # generation_config.json's max_new_tokens (get_diff_sampling_param's max_tokens).
    generation_max_tokens: int | None = None
    # get_diff_sampling_param: generation_config.json's sampling defaults
    # (what the chat route and /render fall back to).
    sampling_defaults: Mapping[str, Any] = dataclass_field(default_factory=dict)

    @property
    def has_parser(self) -> bool:
        """``OnlineDerenderer.parser is not None``: a tool parser (with
        --enable-auto-tool-choice) or a reasoning parser."""
        return self.tool_call_parser is not None or self.reasoning_parser is not None


@dataclass(frozen=True)
class Sampling:
    """``SamplingParams`` as the emulator serves it (after ``__post_init__``)."""

    n: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    max_tokens: int | None
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    detokenize: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    # The structured-outputs constraint given: (field, value), or None.
    constraint: tuple[str, Any] | None
    logit_bias: dict[int, float] | None
    routed_experts_prompt_start: int
    # Fields set to something that changes the output the emulator cannot model.
    unmodelled: tuple[str, ...]


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


def check_cache_salt(salt: Any) -> None:
    """``entrypoints/generate/base/protocol.py`` ``validate_cache_salt`` (a
    "before" model validator of both request models: it runs first, and its
    ``VLLMValidationError`` is not a pydantic error)."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise validation_error(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > 128 or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        raise validation_error(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            "cache_salt",
        )


def _json_body(raw: bytes) -> Any:
    """The body as FastAPI decodes it (``json.loads``: NaN literals pass);
    its ``json_invalid`` error otherwise."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = exc.pos if isinstance(exc, json.JSONDecodeError) else 0
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        errs = _Errors()
        errs.add("json_invalid", ("body", pos), "JSON decode error", {}, {"error": reason})
        raise body_error(errs.items) from None


def check_request(raw: bytes, content_type: str, server: VllmServer) -> GenerateRequest:
    """Every check of the four stages (module docstring), in vLLM's order."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    body = _json_body(raw) if media_type == "application/json" else None
    if media_type != "application/json":
        # validate_json_request: a RequestValidationError of one plain string.
        raise body_error(["Unsupported Media Type: Only 'application/json' is allowed"])
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


def require_object(body: Any) -> dict[str, Any]:
    """pydantic's first check of a model's body: a JSON object (else 400 "Bad Request")."""
    if not isinstance(body, dict):
        errs = _Errors()
        errs.add(
            "model_attributes_type",
            ("body",),
            "Input should be a valid dictionary or object to extract fields from",
            body,
        )
        errs.raise_if_any()
    assert isinstance(body, dict)
    return body


def _parse_body(body: Any) -> _Fields:
    """Stage 1: pydantic's parse of TP ``GenerateRequest`` (`request_models`)."""
    # request_models builds on this module's SamplingParams rules (post_init).
    from rollout_session.emulator.vllm.request_models import GENERATE_BODY

    try:
        request = GENERATE_BODY(body)
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


def _parse_context(context: ParseContextModel, raw: dict[str, Any]) -> ParseContext:
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


def _tools(v: Any, loc: Loc, errs: _Errors) -> tuple[dict[str, Any], ...] | _Bad | None:
    """``list[ChatCompletionToolsParam] | None``: ``{type: "function", function:
    {name, description?, parameters?: dict, strict?}}``."""
    if v is None:
        return None
    items = _list(v, loc, errs)
    if isinstance(items, _Bad):
        return _BAD
    before = len(errs.items)
    for i, tool in enumerate(items):
        at: Loc = (*loc, i)
        if not isinstance(tool, dict):
            errs.add(
                "model_type",
                at,
                "Input should be a valid dictionary or instance of ChatCompletionToolsParam",
                tool,
            )
            continue
        if tool.get("type", "function") != "function":
            errs.add(
                "literal_error",
                (*at, "type"),
                "Input should be 'function'",
                tool.get("type"),
                {"expected": "'function'"},
            )
        function = tool.get("function", _NO_VALUE)
        if function is _NO_VALUE:
            errs.add("missing", (*at, "function"), "Field required", tool)
        elif not isinstance(function, dict):
            errs.add(
                "model_type",
                (*at, "function"),
                "Input should be a valid dictionary or instance of FunctionDefinition",
                function,
            )
        else:
            if "name" not in function:
                errs.add("missing", (*at, "function", "name"), "Field required", function)
            else:
                _str(function["name"], (*at, "function", "name"), errs)
            if function.get("description") is not None:
                _str(function["description"], (*at, "function", "description"), errs)
            if function.get("parameters") is not None:
                _dict(function["parameters"], (*at, "function", "parameters"), errs)
            for flag in ("strict", "defer_loading"):
                if function.get(flag) is not None:
                    _bool(function[flag], (*at, "function", flag), errs)
        if tool.get("defer_loading") is not None:
            _bool(tool["defer_loading"], (*at, "defer_loading"), errs)
    return _BAD if len(errs.items) > before else tuple(items)


# SamplingParams' fields in declaration order (SP L271-450), each with its
# pydantic check. Fields not listed are ignored (unknown keys are dropped).
_SAMPLING_FIELDS: Final[Mapping[str, tuple[Callable[[Any, Loc, _Errors], Any], Any]]] = {
    "n": (_int, 1),
    "presence_penalty": (_float, 0.0),
    "frequency_penalty": (_float, 0.0),
    "repetition_penalty": (_float, 1.0),
    "temperature": (_float, 1.0),
    "watermarking": (_optional(_bool), None),
    "top_p": (_float, 1.0),
    "top_k": (_int, 0),
    "min_p": (_float, 0.0),
    "seed": (_optional(_int), None),
    "stop": (_int_or_str_list, None),
    "stop_token_ids": (_optional(_list_of(_int)), None),
    "ignore_eos": (_bool, False),
    "max_tokens": (_optional(_int), 16),
    "min_tokens": (_int, 0),
    "logprobs": (_optional(_int), None),
    "prompt_logprobs": (_optional(_int), None),
    "prompt_logprob_token_ids": (_optional(_list), None),
    "prompt_logprob_start": (_optional(_int), None),
    "logprob_token_ids": (_optional(_list_of(_int)), None),
    "flat_logprobs": (_bool, False),
    "detokenize": (_bool, True),
    "skip_special_tokens": (_bool, True),
    "spaces_between_special_tokens": (_bool, True),
    "include_stop_str_in_output": (_bool, False),
    "output_kind": (_output_kind, 0),
    "stream_interval": (_optional(_int), None),
    "skip_clone": (_bool, False),
    "output_text_buffer_length": (_int, 0),
    "structured_outputs": (_anything, None),  # checked by _structured_outputs
    "logit_bias": (_optional(_dict), None),
    "allowed_token_ids": (_optional(_list_of(_int)), None),
    "extra_args": (_optional(_dict), None),
    "bad_words": (_optional(_list_of(_str)), None),
    "skip_reading_prefix_cache": (_optional(_bool), None),
    "thinking_token_budget": (_anything, None),  # its BeforeValidator, below
    "repetition_detection": (_optional(_dict), None),
    "routed_experts_prompt_start": (_int, 0),
    "trace_decode_token_ids": (_optional(_list_of(_int)), None),
}


def thinking_token_budget(value: Any) -> int | None:
    """SP ``validate_thinking_token_budget`` (a BeforeValidator raising
    ``VLLMValidationError``)."""
    if value is None:
        return None
    if isinstance(value, bool | float) or not isinstance(value, int) or value < -1:
        raise validation_error(
            "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
            "thinking_token_budget",
            value,
        )
    return None if value == -1 else value


def _structured_outputs(v: Any, loc: Loc, errs: _Errors) -> dict[str, Any] | _Bad | None:
    """SP ``StructuredOutputsParams`` (a dataclass): its field types, then its
    ``__post_init__`` (exactly one constraint; ``VLLMValidationError``)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        errs.add(
            "dataclass_type",
            loc,
            "Input should be a dictionary or an instance of StructuredOutputsParams",
            v,
        )
        return _BAD
    checks: dict[str, Callable[[Any, Loc, _Errors], Any]] = {
        "json": lambda x, at, e: x if isinstance(x, str | dict) or x is None else _str(x, at, e),
        "regex": _optional(_str),
        "choice": _optional(_list_of(_str)),
        "grammar": _optional(_str),
        "json_object": _optional(_bool),
        "disable_any_whitespace": _bool,
        "disable_additional_properties": _bool,
        "whitespace_pattern": _optional(_str),
        "structural_tag": _optional(_str),
    }
    defaults = {name: None for name in checks} | {
        "disable_any_whitespace": False,
        "disable_additional_properties": False,
    }
    before = len(errs.items)
    params = {
        name: check(v[name], (*loc, name), errs) if name in v else defaults[name]
        for name, check in checks.items()
    }
    if len(errs.items) > before:
        return _BAD
    check_one_constraint(params)
    return params


def check_one_constraint(params: Mapping[str, Any]) -> None:
    """SP ``StructuredOutputsParams.__post_init__``: exactly one constraint
    (``VLLMValidationError``)."""
    count = sum(params[name] is not None for name in _CONSTRAINTS)
    if count != 1:
        # Its message prints the dataclass's __dict__ (private fields included).
        shown = {**params, "_backend": None, "_backend_was_auto": False}
        raise validation_error(
            f"You can only use one kind of structured outputs constraint but multiple are "
            f"specified: {shown}"
            if count > 1
            else f"You must use one kind of structured outputs constraint but none are "
            f"specified: {shown}"
        )


def post_init(p: dict[str, Any]) -> Sampling:
    """SP ``SamplingParams.__post_init__`` and ``_verify_args``, in their order."""
    temperature: float = p["temperature"]
    if 0 < temperature < _MAX_TEMP:
        temperature = _MAX_TEMP
    seed = None if p["seed"] == -1 else p["seed"]
    stop = [p["stop"]] if isinstance(p["stop"], str) else list(p["stop"] or [])
    stop_ids = list(dict.fromkeys(p["stop_token_ids"] or []))
    logprobs = p["logprobs"]
    n = p["n"]
    if n < 1:
        raise validation_error(f"n must be at least 1, got {n}.")
    if n > _VLLM_MAX_N_SEQUENCES:
        raise validation_error(
            f"n must be at most {_VLLM_MAX_N_SEQUENCES}, got {n}. To increase this limit, "
            "set the VLLM_MAX_N_SEQUENCES environment variable."
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= p[name] <= 2.0:
            raise validation_error(f"{name} must be in [-2, 2], got {p[name]}.")
    repetition = p["repetition_penalty"]
    if not math.isfinite(repetition):
        raise validation_error(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise validation_error(f"repetition_penalty must be greater than zero, got {repetition}.")
    if not math.isfinite(temperature):
        raise validation_error(
            f"temperature must be a finite number, got {temperature}.", "temperature", temperature
        )
    if temperature < 0.0:
        raise validation_error(
            f"temperature must be non-negative, got {temperature}.", "temperature", temperature
        )
    if temperature > 2.0:
        raise validation_error(
            f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature
        )
    top_p = p["top_p"]
    if not 0.0 < top_p <= 1.0:
        raise validation_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if p["top_k"] < -1:
        raise validation_error(f"top_k must be 0 (disable), or at least 1, got {p['top_k']}.")
    if not 0.0 <= p["min_p"] <= 1.0:
        raise validation_error(f"min_p must be in [0, 1], got {p['min_p']}.")
    max_tokens = p["max_tokens"]
    if max_tokens is not None and max_tokens < 1:
        raise validation_error(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )
    min_tokens = p["min_tokens"]
    if min_tokens < 0:
        raise validation_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise validation_error(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    interval = p["stream_interval"]
    if interval is not None and interval < 1:
        raise validation_error(
            f"stream_interval must be at least 1, got {interval}.", "stream_interval", interval
        )
    if logprobs is not None and logprobs != -1 and logprobs < 0:
        raise validation_error(
            f"logprobs must be non-negative or -1, got {logprobs}.", "logprobs", logprobs
        )
    prompt_logprobs = p["prompt_logprobs"]
    if prompt_logprobs is not None and prompt_logprobs != -1 and prompt_logprobs < 0:
        raise validation_error(
            f"prompt_logprobs must be non-negative or -1, got {prompt_logprobs}.",
            "prompt_logprobs",
            prompt_logprobs,
        )
    if any(not s for s in stop):
        raise validation_error("stop cannot contain an empty string.")
    if stop and not p["detokenize"]:
        raise validation_error(
            "stop strings are only supported when detokenize is True. "
            "Set detokenize=True to use stop."
        )
    bad_words = list(dict.fromkeys(p["bad_words"] or []))
    if any(not w for w in bad_words):
        raise validation_error(
            f"bad_words cannot contain an empty string. Got bad_words={bad_words}"
        )
    if temperature < _SAMPLING_EPS and n > 1:  # _verify_greedy_sampling
        raise validation_error(f"n must be 1 when using greedy sampling, got {n}.")
    structured = p["structured_outputs"]
    constraint = None
    if isinstance(structured, dict):
        constraint = next(
            (name, structured[name]) for name in _CONSTRAINTS if structured[name] is not None
        )
    unmodelled = tuple(
        name
        for name, is_set in (
            ("watermarking", bool(p["watermarking"])),
            ("prompt_logprob_token_ids", p["prompt_logprob_token_ids"] is not None),
            ("prompt_logprob_start", p["prompt_logprob_start"] is not None),
            ("logprob_token_ids", bool(p["logprob_token_ids"])),
            ("allowed_token_ids", p["allowed_token_ids"] is not None),
            ("bad_words", bool(bad_words)),
            ("thinking_token_budget", p["thinking_token_budget"] is not None),
            ("repetition_detection", p["repetition_detection"] is not None),
            ("trace_decode_token_ids", p["trace_decode_token_ids"] is not None),
        )
        if is_set
    )
    return Sampling(
        n=n,
        temperature=temperature,
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=p["ignore_eos"],
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        detokenize=p["detokenize"],
        skip_special_tokens=p["skip_special_tokens"],
        include_stop_str_in_output=p["include_stop_str_in_output"],
        constraint=constraint,
        logit_bias=p["logit_bias"],
        routed_experts_prompt_start=p["routed_experts_prompt_start"],
        unmodelled=unmodelled,
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
        max_tokens = min(
            v for v in (context_length - prompt_len, server.generation_max_tokens) if v is not None
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
