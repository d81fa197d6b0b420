"""What SGLang 0.5.23 checks in a ``/generate`` body, for the emulator.

A ``/generate`` request passes three checks in SGLang, in this order
(paths under ``sglang/``):

1. FastAPI parses the body into ``GenerateReqInput`` (``srt/managers/io_struct.py``,
   a dataclass): a mistyped field is the flat 400 "Bad Request" (pydantic,
   for the fields the emulator honours: `io_struct.check_generate`).
2. The contract gate (``srt/entrypoints/http_server.py`` ``generate_request`` →
   ``srt/entrypoints/api_contract.py`` ``generate_contract_error`` →
   ``api/v1/api_types.py`` ``decode_GenerateRequest``): serde's messages, as
   400 ``{"error": "<text>"}`` (a plain string). Unknown top-level keys are
   ignored; ``sampling_params`` refuses unknown keys; ``null`` is accepted for
   every sampling key (`contract_error`, a port of the generated decoder).
3. ``SamplingParams.normalize`` / ``verify`` (``srt/sampling/sampling_params.py``,
   called by ``TokenizerManager._create_tokenized_object``): a ``ValueError``,
   400 ``{"error": {"message"}}`` (`sampling_error`).

`tool_constraint` reads the tool-call constraint SGLang's chat route would
have built (``srt/function_call/utils.py`` ``get_json_schema_constraint``)
back from ``sampling_params.json_schema``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from rollout_session.emulator.model.forced_call import ToolConstraint, array_tool_constraint

__all__ = [
    "SAMPLING_FIELDS",
    "contract_error",
    "sampling_error",
    "structural_tag_constraint",
    "tool_constraint",
]


class _ContractError(ValueError):
    """A contract violation: the gate's 400 text."""


def _unexpected(v: Any) -> str:
    """serde's ``Unexpected`` display (``api_types._unexpected``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _invalid(v: Any, expected: str) -> _ContractError:
    return _ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


Check = Callable[[Any], None]


def _int(expected: str = "i64") -> Check:
    def check(v: Any) -> None:
        if not _is_int(v):
            raise _invalid(v, expected)

    return check


def _uint(v: Any) -> None:
    if not _is_int(v):
        raise _invalid(v, "u64")
    if v < 0:
        raise _ContractError(f"invalid value: integer `{v}`, expected u64")


def _float(v: Any) -> None:
    if not _is_number(v):
        raise _invalid(v, "f64")


def _bool(expected: str = "a boolean") -> Check:
    def check(v: Any) -> None:
        if not isinstance(v, bool):
            raise _invalid(v, expected)

    return check


def _str(expected: str = "a string") -> Check:
    def check(v: Any) -> None:
        if not isinstance(v, str):
            raise _invalid(v, expected)

    return check


def _seq(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise _invalid(v, "a sequence")
    return v


def _map(v: Any, expected: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _invalid(v, expected)
    return v


def _list_of(item: Check) -> Check:
    def check(v: Any) -> None:
        for e in _seq(v):
            item(e)

    return check


def _optional(item: Check) -> Check:
    def check(v: Any) -> None:
        if v is not None:
            item(v)

    return check


def _one_or_list(name: str, item: Check, items: Check | None = None) -> Check:
    """``XOrList``: one value, or an array (decoded as ``items``, by default
    a list of ``item``)."""
    many = items or _list_of(item)

    def check(v: Any) -> None:
        if isinstance(v, list):
            many(v)
            return
        try:
            item(v)
        except _ContractError:
            raise _invalid(v, f"a value or an array of values for {name}") from None

    return check


def _token_ids_or_list(v: Any) -> None:
    if not isinstance(v, list):
        raise _invalid(v, "a value or an array of values for TokenIdsOrList")
    # [] and [scalar, ...] are one flat list; anything else is a batch.
    if not v or _is_number(v[0]):
        _list_of(_int())(v)
    else:
        _list_of(_list_of(_int()))(v)


def _string_list_or_list(v: Any) -> None:
    if not isinstance(v, list):
        raise _invalid(v, "a value or an array of values for StringListOrList")
    if not v or isinstance(v[0], str):
        _list_of(_str())(v)
    else:
        _list_of(_list_of(_str()))(v)


def _unknown_field(key: str, fields: tuple[str, ...]) -> _ContractError:
    listed = ", ".join(f"`{f}`" for f in fields)
    return _ContractError(f"unknown field `{key}`, expected one of {listed}")


def _struct(name: str, fields: Mapping[str, Check]) -> Check:
    """A JSON object whose unknown keys are refused, every field nullable."""
    names = tuple(fields)

    def check(v: Any) -> None:
        for key, x in _map(v, f"struct {name}").items():
            field = fields.get(key)
            if field is None:
                raise _unknown_field(key, names)
            if x is not None:
                field(x)

    return check


def _float_map(v: Any) -> None:
    for e in _map(v, "a map").values():
        _float(e)


def _str_map(v: Any) -> None:
    for e in _map(v, "a map").values():
        _str()(e)


def _anything(v: Any) -> None:
    return None


_STRING_OR_LIST: Final = _one_or_list("StringOrList", _str())
_BOOL_OR_LIST: Final = _one_or_list("BoolOrList", _bool())
_INT_OR_LIST: Final = _one_or_list("Int64OrList", _int())
_OPT_STRING_OR_LIST: Final = _one_or_list(
    "OptionalStringOrList", _str(), _list_of(_optional(_str()))
)
_OPT_INT_OR_LIST: Final = _one_or_list("OptionalInt64OrList", _int(), _list_of(_optional(_int())))

# api/v1/api_types.py SamplingParams, in _FIELDS_SamplingParams order (the
# order serde lists them in its unknown-field message).
SAMPLING_FIELDS: Final[Mapping[str, Check]] = {
    "max_new_tokens": _int(),
    "stop": _STRING_OR_LIST,
    "stop_token_ids": _list_of(_int()),
    "stop_regex": _STRING_OR_LIST,
    "temperature": _float,
    "top_p": _float,
    "top_k": _int(),
    "min_p": _float,
    "frequency_penalty": _float,
    "presence_penalty": _float,
    "repetition_penalty": _float,
    "min_new_tokens": _int(),
    "n": _int(),
    "json_schema": _str(),
    "regex": _str(),
    "ebnf": _str(),
    "structural_tag": _str(),
    "ignore_eos": _bool(),
    "skip_special_tokens": _bool(),
    "spaces_between_special_tokens": _bool(),
    "no_stop_trim": _bool(),
    "stream_interval": _int(),
    "logit_bias": _float_map,
    "sampling_seed": _int(),
    "custom_params": _anything,
    "beam_width": _int(),
    "watermark": _struct(
        "WatermarkRequestConfig",
        {"enabled": _bool(), "key": _str(), "context_window": _int()},
    ),
    "choice": _list_of(_str()),
}
_sampling_params: Final = _struct("SamplingParams", SAMPLING_FIELDS)


def _sampling_params_or_list(v: Any) -> None:
    if isinstance(v, list):
        for e in v:
            _sampling_params(e)
    else:
        _sampling_params(_map(v, "a value or an array of values for SamplingParamsOrList"))


# api/v1/api_types.py GenerateRequest: (check, null accepted). Fields whose
# decoders the emulator does not port (media, kv_hints, images_config) are
# taken as they come; the emulator refuses media after the gate.
_REQUEST_FIELDS: Final[Mapping[str, tuple[Check, bool]]] = {
    "rid": (_STRING_OR_LIST, True),
    "text": (_STRING_OR_LIST, True),
    "input_ids": (_token_ids_or_list, True),
    "stream": (_bool(), True),
    "sampling_params": (_sampling_params_or_list, True),
    "return_logprob": (_BOOL_OR_LIST, True),
    "logprob_start_len": (_INT_OR_LIST, True),
    "top_logprobs_num": (_INT_OR_LIST, True),
    "token_ids_logprob": (_token_ids_or_list, True),
    "return_hidden_states": (_BOOL_OR_LIST, True),
    "return_text_in_logprobs": (_bool(), True),
    "bootstrap_host": (_OPT_STRING_OR_LIST, True),
    "bootstrap_port": (_OPT_INT_OR_LIST, True),
    "bootstrap_room": (_OPT_INT_OR_LIST, True),
    "bootstrap_pair_key": (_OPT_STRING_OR_LIST, True),
    "decode_tp_size": (_OPT_INT_OR_LIST, True),
    "routed_dp_rank": (_int(), True),
    "disagg_prefill_dp_rank": (_int(), True),
    "image_data": (_anything, True),
    "mm_hashes": (_string_list_or_list, True),
    "video_data": (_anything, True),
    "audio_data": (_anything, True),
    "extra_key": (_STRING_OR_LIST, True),
    "priority": (_int(), True),
    "cache_salt": (_STRING_OR_LIST, True),
    "require_reasoning": (_bool(), True),
    "lora_path": (_OPT_STRING_OR_LIST, True),
    "session_params": (_anything, True),
    "kv_hints": (_anything, True),
    "routing_key": (_str(), True),
    "max_thinking_tokens": (_uint, True),
    "session_id": (_str(), True),
    "custom_logit_processor": (_OPT_STRING_OR_LIST, True),
    "custom_labels": (_str_map, True),
    "images_config": (_anything, True),
    "return_prompt_token_ids": (_bool(), False),
    "routed_experts_start_len": (_int(), False),
    "return_sampling_mask": (_BOOL_OR_LIST, True),
    "modalities": (_list_of(_optional(_str())), True),
}


def contract_error(body: Mapping[str, Any]) -> str | None:
    """The contract gate's 400 text for a parsed ``/generate`` body, or None.

    Keys are checked in the body's order and the first violation is the
    answer, as in ``decode_GenerateRequest``.
    """
    try:
        for key, value in body.items():
            spec = _REQUEST_FIELDS.get(key)
            if spec is None:
                continue  # unknown top-level keys are ignored
            check, nullable = spec
            if value is None and nullable:
                continue
            check(value)
    except _ContractError as exc:
        return str(exc)
    return None


# srt/sampling/sampling_params.py
_SAMPLING_EPS: Final = 1e-6
_TOP_K_ALL: Final = 1 << 30
_MAX_STOP_COUNT: Final = 32
_MAX_STOP_REGEX_COUNT: Final = 32
_MAX_STOP_REGEX_LEN: Final = 256
_GRAMMARS: Final = ("json_schema", "regex", "ebnf", "structural_tag")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def sampling_error(sampling: Mapping[str, Any], vocab_size: int) -> str | None:
    """``SamplingParams.__post_init__``, ``normalize`` and ``verify`` of
    gate-checked ``sampling_params``: SGLang's ValueError text, or None.
    (The reasoning-end-token and watermark checks are not modelled.)"""
    for key, limit, what in (
        ("stop", _MAX_STOP_COUNT, "stop strings"),
        ("stop_regex", _MAX_STOP_REGEX_COUNT, "stop_regex patterns"),
    ):
        value = sampling.get(key)
        values = [value] if isinstance(value, str) else list(value or [])
        if len(values) > limit:
            return f"at most {limit} {what} are allowed, got {len(values)}"
        if key == "stop_regex":
            for regex in values:
                size = len(regex.encode("utf-8"))
                if size > _MAX_STOP_REGEX_LEN:
                    return f"stop_regex is {size} bytes, over the {_MAX_STOP_REGEX_LEN}-byte limit"
    temperature = _or(sampling.get("temperature"), 1.0)
    top_k = _or(sampling.get("top_k"), -1)
    if 0 <= temperature < _SAMPLING_EPS:  # greedy
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = _TOP_K_ALL
    top_p = _or(sampling.get("top_p"), 1.0)
    min_p = _or(sampling.get("min_p"), 0.0)
    frequency = _or(sampling.get("frequency_penalty"), 0.0)
    presence = _or(sampling.get("presence_penalty"), 0.0)
    repetition = _or(sampling.get("repetition_penalty"), 1.0)
    min_new = _or(sampling.get("min_new_tokens"), 0)
    max_new = sampling.get("max_new_tokens", 128)
    beam_width = sampling.get("beam_width")
    if beam_width is not None and beam_width < 1:
        return f"beam_width must be at least 1, got {beam_width}."
    if not math.isfinite(temperature) or temperature < 0.0:
        return f"temperature must be a non-negative finite number, got {temperature}."
    if not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    if not 0.0 <= min_p <= 1.0:
        return f"min_p must be in [0, 1], got {min_p}."
    if top_k < 1:
        return f"top_k must be -1 (disable) or at least 1, got {top_k}."
    if not -2.0 <= frequency <= 2.0:
        return f"frequency_penalty must be in [-2, 2], got {frequency}."
    if not -2.0 <= presence <= 2.0:
        return f"presence_penalty must be in [-2, 2], got {presence}."
    if not 0.0 < repetition <= 2.0:
        return f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition}."
    if min_new < 0:
        return f"min_new_tokens must be in [0, max_new_tokens], got {min_new}."
    if max_new is not None:
        if max_new < 0:
            return f"max_new_tokens must be at least 0, got {max_new}."
        if not min_new <= max_new:
            return f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}."
    for token_id in sampling.get("logit_bias") or {}:
        try:
            index = int(token_id)
        except ValueError as exc:
            return str(exc)
        if not 0 <= index < vocab_size:
            return f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}."
    seed = sampling.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        return f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}."
    # An empty grammar is unset (__post_init__: `self.json_schema or None`).
    if sum(bool(sampling.get(g)) for g in _GRAMMARS) > 1:
        return "Only one of json_schema, regex, ebnf, or structural_tag can be set."
    return None


def tool_constraint(json_schema: Any) -> ToolConstraint:
    """The constraint SGLang's ``get_json_schema_constraint`` wrote into
    ``json_schema`` (``srt/function_call/utils.py``): an array of
    ``{name, parameters}`` items whose ``items`` is ``{"anyOf": [...]}``
    (tool_choice "required") or one tool's schema, its ``name`` an enum of
    that one name (a named tool_choice). Any other schema (a response
    format) forces no call. Raises ValueError with SGLang's message when the
    schema is not JSON (``xgrammar_backend.dispatch_json`` →
    ``grammar_manager``: "Failed to compile json grammar: ...")."""
    if not json_schema:  # None or "" (unset)
        return ToolConstraint()
    try:
        schema = json.loads(json_schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Failed to compile json grammar: {exc}") from exc
    return array_tool_constraint(schema) or ToolConstraint()


def structural_tag_constraint(structural_tag: Any) -> ToolConstraint:
    """The tool call SGLang's legacy structural tag forces
    (``FunctionCallParser.get_legacy_structural_tag``): ``at_least_one``
    means a call of any offered tool (a named tool_choice is not narrowed by
    it); otherwise the model calls or not as it would. Raises ValueError with
    SGLang's message when the tag is not JSON."""
    if not structural_tag:
        return ToolConstraint()
    try:
        tag = json.loads(structural_tag)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Failed to compile structural tag grammar: {exc}") from exc
    if isinstance(tag, dict) and tag.get("at_least_one") is True:
        return ToolConstraint("required")
    return ToolConstraint()
