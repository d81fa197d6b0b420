"""What SGLang 0.5.23's ``SamplingParams`` checks in a ``/generate`` request, and
the tool call its grammar forces, for the emulator.

Models ``srt/sampling/sampling_params.py`` ``SamplingParams.normalize`` /
``verify`` (called by ``srt/managers/tokenizer_manager.py``
``TokenizerManager._create_tokenized_object``): a ``ValueError``, 400
``{"error": {"message"}}`` (`sampling_error`); they run after FastAPI's
parse (`io_struct`) and the contract gate (`contract_gate`).
`tool_constraint` reads the tool-call constraint SGLang's chat route would
have built (``srt/function_call/utils.py`` ``get_json_schema_constraint``)
back from ``sampling_params.json_schema``; `structural_tag_constraint`
the one of its legacy structural tag.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

from rollout_session.emulator.model.forced_call import ToolConstraint, array_tool_constraint

__all__ = [
    "sampling_error",
    "structural_tag_constraint",
    "tokenizer_required",
    "tool_constraint",
]


# srt/sampling/sampling_params.py
_SAMPLING_EPS: Final = 1e-6
_TOP_K_ALL: Final = 1 << 30
_MAX_STOP_COUNT: Final = 32
_MAX_STOP_REGEX_COUNT: Final = 32
_MAX_STOP_REGEX_LEN: Final = 256
_GRAMMARS: Final = ("json_schema", "regex", "ebnf", "structural_tag")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def sampling_error(
    sampling: Mapping[str, Any], vocab_size: int, *, skip_tokenizer_init: bool = False
) -> str | None:
    """``SamplingParams.__post_init__``, ``normalize`` and ``verify`` of
    gate-checked ``sampling_params``: SGLang's ValueError text, or None.
    ``skip_tokenizer_init``: ``normalize`` gets no tokenizer
    (`tokenizer_required`). (The reasoning-end-token and watermark checks
    are not modelled.)"""
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
    if skip_tokenizer_init:
        needs = tokenizer_required(sampling)
        if needs is not None:
            return needs
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


def tokenizer_required(sampling: Mapping[str, Any]) -> str | None:
    """``normalize(None)``'s refusal of what needs a tokenizer
    (``raise_if_tokenizer_required``, the engine launched with
    ``--skip-tokenizer-init``): stop strings and stop regexes are matched on
    decoded text, ``min_new_tokens`` needs the EOS id. None when none is set."""
    for key in ("stop", "stop_regex"):
        value = sampling.get(key)
        values = [value] if isinstance(value, str) else value
        if values:
            return (
                f"{key}={values!r} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer to decode tokens to text for matching)."
            )
    min_new = sampling.get("min_new_tokens")
    if isinstance(min_new, int) and min_new > 0:
        return (
            f"min_new_tokens={min_new} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer for eos_token_id)."
        )
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
