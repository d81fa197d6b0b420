"""pydantic models of vLLM 0.33.0's token-in/token-out requests, for the emulator.

vLLM validates these bodies with pydantic (FastAPI); the models here have
the same names (pydantic's errors name them), field types, lax coercions,
defaults and validators, so the emulator refuses what vLLM refuses in
pydantic's own words. TP = ``vllm/entrypoints/scale_out/token_in_token_out/
protocol.py``:

- `GenerateRequest` (``POST /inference/v1/generate``): TP
  ``GenerateRequest``, a plain ``BaseModel`` (unknown keys ignored), its
  ``validate_token_ids`` and model validators: ``_validate_cache_salt``
  ("before"; its ``VLLMValidationError`` escapes pydantic), then
  ``_check_mm_fields_exclusive``, ``_check_output_mode_detokenizes``,
  ``_check_parse_context_fields`` ("after", in that order; the multimodal
  ones that need ``features`` are moot: the emulator refuses features).
  `ParseContext` (``extra="allow"``) and `ReasoningParserKwargs`
  (``extra="forbid"``) are TP's; ``sampling_params`` is
  `sampling.SamplingParams`.
- `DerenderChatRequest` | `DerenderChatStreamRequest`
  (``POST /v1/chat/completions/derender``): TP ``DerenderChatRequestUnion``,
  a plain union: when both members fail pydantic reports the errors of
  both, each ``loc`` naming its member. ``generate_response`` is TP
  ``GenerateTokensResponse`` (its choices, logprobs, usage; ``outputs.py``
  ``WeightVersionSpan``); ``chat_request`` is `chat_protocol.ChatCompletionRequest`.
  The streaming member's chunk and state are typed ``Any``: the emulator
  refuses streaming derender whenever they are sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    NonNegativeInt,
    TypeAdapter,
    field_validator,
    model_validator,
)

from rollout_session.emulator.vllm.chat_protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    check_cache_salt,
    random_uuid,
)
from rollout_session.emulator.vllm.sampling import Sampling, SamplingParams

__all__ = [
    "DERENDER_BODY",
    "GENERATE_BODY",
    "DerenderChatRequest",
    "DerenderChatStreamRequest",
    "GenerateRequest",
    "GenerateTokensResponse",
    "ParseContext",
]


class ParseContext(BaseModel):
    """TP ``ParseContext``: unknown keys are kept (a newer /render's)."""

    model_config = ConfigDict(extra="allow")

    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = (
        "none"
    )
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    history_tool_call_cnt: int = Field(default=0, ge=0)


class ReasoningParserKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class GenerateRequest(BaseModel):
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
    parse_context: ParseContext | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # StreamOptions: streaming is refused
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _validate_token_ids(cls, value: list[int]) -> list[int]:
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
    def _check_mm_fields_exclusive(self) -> GenerateRequest:
        if self.content_parts and self.features:
            raise ValueError("content_parts and features are mutually exclusive")
        return self

    @model_validator(mode="after")
    def _check_output_mode_detokenizes(self) -> GenerateRequest:
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ValueError(
                f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be true"
            )
        return self

    @model_validator(mode="after")
    def _check_parse_context_fields(self) -> GenerateRequest:
        context = self.parse_context
        extra = sorted(context.model_extra or ()) if context is not None else []
        if extra and self.output_mode == "derender":
            raise ValueError(
                f"Unknown parse_context fields {extra}; the render server is newer than "
                "this generate server"
            )
        return self


# -- /v1/chat/completions/derender ------------------------------------------------


class GenerateLogProb(BaseModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


@dataclass
class WeightVersionSpan:
    """``outputs.py`` ``WeightVersionSpan``."""

    version: str
    start: int
    end: int


class GenerateTokensChoice(BaseModel):
    """TP ``GenerateChoiceBase`` + ``GenerateTokensChoice``."""

    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    logprobs: GenerateLogProbs | None = None

    @field_validator("token_ids")
    @classmethod
    def _validate_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token_ids must not contain negative values")
        return value


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None
    created_cache_tokens: int | None = None
    multimodal_tokens: dict[str, int] | None = None


class CompletionTokenUsageInfo(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    """``entrypoints/serve/engine/protocol.py`` ``UsageInfo``."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    completion_tokens_details: CompletionTokenUsageInfo | None = None


class PerRequestMetrics(BaseModel):
    """Its contents are refused as not modelled: any object passes here."""

    model_config = ConfigDict(extra="allow")


class GenerateTokensResponse(BaseModel):
    """TP ``GenerateResponseBase`` + ``GenerateTokensResponse``, in declaration
    order; ``prompt_logprobs`` and ``mm_placeholders`` typed only outside
    (their contents are refused as not modelled when set)."""

    request_id: str = Field(default_factory=random_uuid)
    model: str | None = None
    created: int | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: list[Any] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[NonNegativeInt] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: PerRequestMetrics | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateTokensChoice]


class DerenderChatRequest(BaseModel):
    """TP ``DerenderChatRequest`` (non-streaming)."""

    stream: Literal[False] = False
    model: str | None = None
    generate_response: GenerateTokensResponse
    prompt_tokens: int | None = None
    prompt_token_ids: list[NonNegativeInt] | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderChatStreamRequest(BaseModel):
    """TP ``DerenderChatStreamRequest``: its chunk and state are not modelled."""

    stream: Literal[True]
    model: str | None = None
    generate_chunk: Any
    stream_state: Any = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[NonNegativeInt] | None = None
    chat_request: ChatCompletionRequest | None = None


# Built once: validating a body is one call into pydantic-core.
GENERATE_BODY: Final[Callable[[Any], GenerateRequest]] = TypeAdapter(
    GenerateRequest
).validate_python
DERENDER_BODY: Final[Callable[[Any], DerenderChatRequest | DerenderChatStreamRequest]] = (
    TypeAdapter(DerenderChatRequest | DerenderChatStreamRequest).validate_python
)
