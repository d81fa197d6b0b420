"""SGLang 0.5.23's contract gate on ``/generate`` bodies, for the emulator.

Models ``srt/entrypoints/http_server.py`` ``generate_request`` →
``srt/entrypoints/api_contract.py`` ``generate_contract_error`` →
``api/v1/api_types.py`` ``decode_GenerateRequest``, a decoder generated
from the API's Rust types: serde's messages, as 400 ``{"error": "<text>"}``
(a plain string). Unknown top-level keys are ignored; ``sampling_params``
refuses unknown keys; ``null`` is accepted for every sampling key. Keys
are checked in the body's order and the first violation is the answer
(`contract_error`, a port of the generated decoder; the media,
``kv_hints`` and ``images_config`` decoders are not ported). It runs
after FastAPI's parse (`io_struct.check_generate`) and before
``SamplingParams``' checks (`generate_params`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["SAMPLING_FIELDS", "contract_error"]


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
