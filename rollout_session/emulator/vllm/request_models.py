"""pydantic models of the body vLLM 0.33.0 parses for ``POST /inference/v1/generate``.

vLLM validates this body with pydantic (FastAPI); these models give the
same field types, lax coercions, defaults and errors, so the emulator
refuses what vLLM refuses in pydantic's own words (paths under ``vllm/``):

- `GenerateBody`: ``entrypoints/scale_out/token_in_token_out/protocol.py``
  ``GenerateRequest`` (a plain ``BaseModel``: unknown keys ignored), its
  ``validate_token_ids`` and its model validators: ``_validate_cache_salt``
  ("before": ``entrypoints/generate/base/protocol.py`` ``validate_cache_salt``,
  whose ``VLLMValidationError`` is no ``ValueError``, so it escapes pydantic),
  then ``_check_mm_fields_exclusive``, ``_check_output_mode_detokenizes``,
  ``_check_parse_context_fields`` ("after", in that order);
- `ParseContextModel`, `ReasoningParserKwargs`: the same module's
  ``ParseContext`` (``extra="allow"``) and ``ReasoningParserKwargs``
  (``extra="forbid"``); `ToolParam`, `FunctionDefinition`,
  `NamedToolChoice`: ``entrypoints/openai/chat_completion/protocol.py``
  ``ChatCompletionToolsParam``, ``ChatCompletionNamedToolChoiceParam`` and
  ``entrypoints/generate/base/protocol.py`` ``FunctionDefinition``
  (``OpenAIBaseModel``: extra keys kept);
- `SamplingParams`: ``sampling_params.py`` ``SamplingParams``, a
  ``msgspec.Struct`` that ``v1/serial_utils.py``
  ``PydanticMsgspecMixin.__get_pydantic_core_schema__`` exposes to pydantic
  as a union of "an instance of SamplingParams" and a typed dict of its
  fields converted by ``cls(**value)`` (``__post_init__``): a bad field is
  reported under both branches, the instance branch first. Its
  ``VLLMValidationError`` escapes pydantic as `VllmError`;
  `StructuredOutputsParams` is the dataclass of the same name (its
  ``__post_init__``: exactly one constraint).

`generate.check_request` turns a ``ValidationError`` into vLLM's 400 with
`generate.pydantic_error` (``handlers/validation.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    JsonValue,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic_core import core_schema
from typing_extensions import TypedDict

from rollout_session.emulator.vllm.generate import (
    Sampling,
    check_cache_salt,
    check_one_constraint,
    post_init,
    random_uuid,
    thinking_token_budget,
)

__all__ = [
    "GENERATE_BODY",
    "GenerateBody",
    "ParseContextModel",
    "SamplingParams",
    "StructuredOutputsParams",
]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ToolParam(BaseModel):
    """``ChatCompletionToolsParam``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None


class _NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str


class NamedToolChoice(BaseModel):
    """``ChatCompletionNamedToolChoiceParam``."""

    model_config = ConfigDict(extra="allow")

    function: _NamedFunction
    type: Literal["function"] = "function"


class ParseContextModel(BaseModel):
    """TP ``ParseContext``: unknown keys are kept (a newer /render's)."""

    model_config = ConfigDict(extra="allow")

    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    history_tool_call_cnt: int = Field(default=0, ge=0)


class ReasoningParserKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


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


class _SamplingFields(TypedDict, total=False):
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
        fields = handler.generate_schema(_SamplingFields)
        return core_schema.union_schema(
            [
                core_schema.is_instance_schema(cls),
                core_schema.no_info_after_validator_function(_to_sampling, fields),
            ]
        )


class GenerateBody(BaseModel):
    """TP ``GenerateRequest``, field by field in declaration order."""

    request_id: str = Field(default_factory=random_uuid)
    token_ids: list[int] = Field(min_length=1)
    token_offsets: list[tuple[int, int]] | None = None
    features: dict[str, Any] | None = None  # MultiModalFeatures: refused (a text model)
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: Annotated[Sampling, SamplingParams]
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: ReasoningParserKwargs | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    parse_context: ParseContextModel | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # StreamOptions: refused with stream
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token_ids must not contain negative values")
        return value

    @model_validator(mode="before")
    @classmethod
    def _validate_cache_salt(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_cache_salt(data.get("cache_salt"))
        return data

    @model_validator(mode="after")
    def _check_mm_fields_exclusive(self) -> GenerateBody:
        if self.content_parts and self.features:
            raise ValueError("content_parts and features are mutually exclusive")
        return self

    @model_validator(mode="after")
    def _check_output_mode_detokenizes(self) -> GenerateBody:
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ValueError(
                f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be true"
            )
        return self

    @model_validator(mode="after")
    def _check_parse_context_fields(self) -> GenerateBody:
        context = self.parse_context
        extra = sorted(context.model_extra or ()) if context is not None else []
        if extra and self.output_mode == "derender":
            raise ValueError(
                f"Unknown parse_context fields {extra}; the render server is newer than "
                "this generate server"
            )
        return self


# Built once: validating a body is one call into pydantic-core.
GENERATE_BODY: Final[Callable[[Any], GenerateBody]] = TypeAdapter(GenerateBody).validate_python
