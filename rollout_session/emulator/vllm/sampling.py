"""vLLM 0.33.0's ``SamplingParams``, for the emulator (paths under ``vllm/``).

Models ``sampling_params.py``: the fields (`SamplingFields`, their types
and defaults), how pydantic reads them (`SamplingParams`: the union of
"an instance" and a typed dict converted by ``cls(**value)`` that
``v1/serial_utils.py`` ``PydanticMsgspecMixin.__get_pydantic_core_schema__``
builds for a ``msgspec.Struct``: a bad field fails both branches, the
instance's first), ``StructuredOutputsParams`` (a dataclass: exactly one
constraint, `check_one_constraint`), ``validate_thinking_token_budget``
(`thinking_token_budget`) and ``SamplingParams.__post_init__`` /
``_verify_args`` (`post_init`). Their ``VLLMValidationError`` is no
``ValueError``: it escapes pydantic as `VllmError`, a 400
``BadRequestError``, whatever else is wrong. `Sampling` is what the
emulator serves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import BeforeValidator, GetCoreSchemaHandler
from pydantic_core import core_schema
from typing_extensions import TypedDict

from rollout_session.emulator.vllm.errors import validation_error

__all__ = [
    "CONSTRAINTS",
    "SAMPLING_DEFAULTS",
    "VLLM_MAX_N_SEQUENCES",
    "Sampling",
    "SamplingFields",
    "SamplingParams",
    "StructuredOutputsParams",
    "check_one_constraint",
    "post_init",
]

# SamplingParams.__post_init__: a temperature in (0, 0.01) is raised to 0.01.
_MAX_TEMP: Final = 1e-2
SAMPLING_EPS: Final = 1e-5
VLLM_MAX_N_SEQUENCES: Final = 16384  # envs.py default
# StructuredOutputsParams' constraint fields, in declaration order.
CONSTRAINTS: Final = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


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


def check_one_constraint(params: Mapping[str, Any]) -> None:
    """SP ``StructuredOutputsParams.__post_init__``: exactly one constraint
    (``VLLMValidationError``)."""
    count = sum(params[name] is not None for name in CONSTRAINTS)
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


@dataclasses.dataclass
class StructuredOutputsParams:
    """SP ``StructuredOutputsParams``: its fields, then exactly one constraint."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        check_one_constraint(self.fields())

    def fields(self) -> dict[str, Any]:
        """Its fields by name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class SamplingFields(TypedDict, total=False):
    """SP ``SamplingParams``' public fields, in declaration order."""

    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    watermarking: bool | None
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool
    max_tokens: int | None
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    prompt_logprob_token_ids: list[Any] | None
    prompt_logprob_start: int | None
    logprob_token_ids: list[int] | None
    flat_logprobs: bool
    detokenize: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    output_kind: Literal[0, 1, 2]  # RequestOutputKind (serve_tokens overwrites it)
    stream_interval: int | None
    skip_clone: bool
    output_text_buffer_length: int
    structured_outputs: StructuredOutputsParams | None
    logit_bias: dict[int, float] | None
    allowed_token_ids: list[int] | None
    extra_args: dict[str, Any] | None
    bad_words: list[str] | None
    skip_reading_prefix_cache: bool | None
    # validate_thinking_token_budget: a BeforeValidator raising VLLMValidationError.
    thinking_token_budget: Annotated[int | None, BeforeValidator(thinking_token_budget)]
    repetition_detection: dict[str, Any] | None
    routed_experts_prompt_start: int
    trace_decode_token_ids: list[int] | None


# SamplingParams' defaults for the fields read after __post_init__.
SAMPLING_DEFAULTS: Final[dict[str, Any]] = {
    "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "temperature": 1.0, "watermarking": None, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    "seed": None, "stop": None, "stop_token_ids": None, "ignore_eos": False,
    "max_tokens": 16, "min_tokens": 0, "logprobs": None, "prompt_logprobs": None,
    "prompt_logprob_token_ids": None, "prompt_logprob_start": None,
    "logprob_token_ids": None, "flat_logprobs": False, "detokenize": True,
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False, "output_kind": 0, "stream_interval": None,
    "skip_clone": False, "output_text_buffer_length": 0, "structured_outputs": None,
    "logit_bias": None, "allowed_token_ids": None, "extra_args": None, "bad_words": None,
    "skip_reading_prefix_cache": None, "thinking_token_budget": None,
    "repetition_detection": None, "routed_experts_prompt_start": 0,
    "trace_decode_token_ids": None,
}  # fmt: skip


def _to_sampling(fields: dict[str, Any]) -> Sampling:
    """``cls(**value)``: the defaults, then ``__post_init__`` (`post_init`)."""
    params = {**SAMPLING_DEFAULTS, **fields}
    structured = params["structured_outputs"]
    if isinstance(structured, StructuredOutputsParams):
        params["structured_outputs"] = structured.fields()
    return post_init(params)


class SamplingParams:
    """Stands for vLLM's ``SamplingParams`` struct in a pydantic model: the
    mixin's union schema (an instance, or its typed dict → ``cls(**value)``)."""

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        fields = handler.generate_schema(SamplingFields)
        return core_schema.union_schema(
            [
                core_schema.is_instance_schema(cls),
                core_schema.no_info_after_validator_function(_to_sampling, fields),
            ]
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
    if n > VLLM_MAX_N_SEQUENCES:
        raise validation_error(
            f"n must be at most {VLLM_MAX_N_SEQUENCES}, got {n}. To increase this limit, "
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
    if temperature < SAMPLING_EPS and n > 1:  # _verify_greedy_sampling
        raise validation_error(f"n must be 1 when using greedy sampling, got {n}.")
    structured = p["structured_outputs"]
    constraint = None
    if isinstance(structured, dict):
        constraint = next(
            (name, structured[name]) for name in CONSTRAINTS if structured[name] is not None
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
