"""pydantic models of vLLM 0.33.0's chat request, for the emulator (paths under ``vllm/``).

vLLM parses a ``/v1/chat/completions/render`` body (and a derender
request's ``chat_request``) into ``entrypoints/openai/chat_completion/
protocol.py`` ``ChatCompletionRequest`` (CP) with pydantic; `ChatCompletionRequest`
has its fields, types, defaults and bounds in declaration order, so a
mistyped field is pydantic's own 400. Its "before" model validators
(`before_validators`: ``check_generation_prompt``, ``check_tool_usage``,
``check_structured_outputs_count``, ``check_logprobs``,
``validate_stream_options``, ``validate_response_format``,
``_normalize_messages_before``, ``check_cache_salt_support``, run
last-defined first as pydantic runs them) raise ``VLLMValidationError``,
which is no ``ValueError``: it escapes pydantic as `VllmError` before any
field is read. The tool and stream models are CP's
``ChatCompletionToolsParam`` and ``entrypoints/generate/base/protocol.py``'s
``FunctionDefinition``, ``StreamOptions`` and ``validate_cache_salt``
(`check_cache_salt`): ``OpenAIBaseModel``, unknown keys kept.

Fields typed ``Any`` here are read by the emulator's own checks
(``messages``: `render._conversation` renders text messages and refuses
the rest as not modelled; ``tool_choice``: ``check_tool_usage``;
``response_format``: `render._response_format`) or refused as not
modelled whenever set (``reasoning_effort``, ``repetition_detection``).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

from rollout_session.emulator.vllm.errors import validation_error
from rollout_session.emulator.vllm.sampling import (
    StructuredOutputsParams,
    thinking_token_budget,
)

__all__ = [
    "CHAT_BODY",
    "Chat",
    "ChatCompletionNamedToolChoiceParam",
    "ChatCompletionRequest",
    "ChatCompletionToolsParam",
    "FunctionDefinition",
    "StreamOptions",
    "chat_request",
    "check_cache_salt",
    "named_tool",
    "random_uuid",
]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# entrypoints/generate/base/protocol.py validate_cache_salt.
_CACHE_SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
# envs.py VLLM_MAX_STOP_STRINGS (StopParam's list bound).
_MAX_STOP_STRINGS: Final = 4


def named_tool(choice: Any) -> str | None:
    """The function a named ``tool_choice`` (a dict, as sent) names, else None."""
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def random_uuid() -> str:
    """``utils/__init__.py`` ``random_uuid``: 16 lowercase hex digits."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ChatCompletionToolsParam(BaseModel):
    """CP ``ChatCompletionToolsParam``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None

    def dump(self) -> dict[str, Any]:
        """``model_dump()``: ``{type, function: {name, description,
        parameters[, strict][, defer_loading]}[, defer_loading]}`` (its
        serializers drop unknown keys and unset flags; ``_propagate_defer_loading``
        copies the tool's ``defer_loading`` to its function's)."""
        function = self.function
        dumped: dict[str, Any] = {
            "name": function.name,
            "description": function.description,
            "parameters": copy.deepcopy(function.parameters),
        }
        if function.strict is not None:
            dumped["strict"] = function.strict
        defer = self.defer_loading if function.defer_loading is None else function.defer_loading
        if defer is not None:
            dumped["defer_loading"] = defer
        out: dict[str, Any] = {"type": "function", "function": dumped}
        if self.defer_loading is not None:
            out["defer_loading"] = self.defer_loading
        return out


class ChatCompletionNamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str


class ChatCompletionNamedToolChoiceParam(BaseModel):
    """CP ``ChatCompletionNamedToolChoiceParam``."""

    model_config = ConfigDict(extra="allow")

    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


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


def before_validators(data: dict[str, Any]) -> None:
    """CP's "before" model validators, last-defined first (as pydantic runs
    them); each raises ``VLLMValidationError``."""
    # check_generation_prompt
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise validation_error(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    _check_tool_usage(data)
    _check_structured_outputs_count(data)
    _check_logprobs(data)
    # validate_stream_options
    if data.get("stream_options") and not data.get("stream"):
        raise validation_error(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    # validate_response_format
    fmt = data.get("response_format")
    if (
        isinstance(fmt, dict)
        and fmt.get("type") == "json_schema"
        and fmt.get("json_schema") is None
    ):
        raise validation_error(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            "response_format",
        )
    # _normalize_messages_before: reasoning_content is read as reasoning.
    messages = data.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                reasoning = message.pop("reasoning_content", None)
                if reasoning is not None and message.get("reasoning") is None:
                    message["reasoning"] = reasoning
    check_cache_salt(data.get("cache_salt"))  # check_cache_salt_support


def _check_tool_usage(data: dict[str, Any]) -> None:
    """CP ``check_tool_usage``; sets the default ``tool_choice`` "auto"."""
    if data.get("tools") == []:
        raise validation_error(
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely.",
            "tools",
        )
    if "tool_choice" not in data and data.get("tools"):
        data["tool_choice"] = "auto"
    choice = data.get("tool_choice")
    if choice == "none" or choice is None:
        return
    if data.get("tools") is None:
        raise validation_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise validation_error(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" '
            'or "required" are supported.',
            "tool_choice",
        )
    if not isinstance(choice, dict):
        return
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise validation_error(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
            "tool_choice.function",
        )
    if "name" not in function:
        raise validation_error(
            f"Expected field `name` in `function` in `tool_choice`! {usage}",
            "tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise validation_error(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
            "tool_choice.function.name",
        )
    tools = data["tools"] if isinstance(data["tools"], list) else []
    if not any(
        isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and t["function"].get("name") == name
        for t in tools
    ):
        raise validation_error(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )


def _check_structured_outputs_count(data: dict[str, Any]) -> None:
    """CP ``check_structured_outputs_count`` (its structural-tag validation
    aside: a user's structural tag is refused as not modelled later)."""
    params = data.get("structured_outputs")
    if not isinstance(params, dict):
        return
    count = sum(params.get(k) is not None for k in ("json", "regex", "choice"))
    if count > 1:
        raise validation_error(
            "You can only use one kind of constraints for structured outputs ('json', "
            "'regex' or 'choice')."
        )
    if count > 0 and data.get("tool_choice", "none") not in ("none", "auto", "required"):
        raise validation_error(
            "You can only either use constraints for structured outputs or tools, not both."
        )


def _check_logprobs(data: dict[str, Any]) -> None:
    """CP ``check_logprobs``."""
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        raise validation_error(
            "`logprob_token_ids` is not supported with beam search.", "logprob_token_ids"
        )
    if data.get("logprob_token_ids") and not data.get("logprobs"):
        raise validation_error(
            "when using `logprob_token_ids`, `logprobs` must be set to true.",
            "logprob_token_ids",
        )
    for name in ("prompt_logprobs", "top_logprobs"):
        value = data.get(name)
        if value is not None and not isinstance(value, int | float):
            raise validation_error(f"`{name}` must be an integer.", name, value)
    prompt = data.get("prompt_logprobs")
    if prompt is not None:
        if data.get("stream") and (prompt > 0 or prompt == -1):
            raise validation_error(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        if prompt < 0 and prompt != -1:
            raise validation_error(
                "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", prompt
            )
    top = data.get("top_logprobs")
    if top is not None:
        if top < 0 and top != -1:
            raise validation_error(
                "`top_logprobs` must be a positive value or -1.", "top_logprobs", top
            )
        if (top == -1 or top > 0) and not data.get("logprobs"):
            raise validation_error(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )


class ChatCompletionRequest(BaseModel):
    """CP ``ChatCompletionRequest``, its fields in declaration order."""

    model_config = ConfigDict(extra="allow")

    messages: list[Any]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    # TopLogprobsParam: null is 0.
    top_logprobs: Annotated[int, BeforeValidator(lambda v: 0 if v is None else v)] = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    response_format: Any = None
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | Annotated[list[str], Field(max_length=_MAX_STOP_STRINGS)] | None = Field(
        default_factory=list
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Any = "none"
    reasoning_effort: Any = None
    thinking_token_budget: Annotated[int | None, BeforeValidator(thinking_token_budget)] = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str = Field(default_factory=random_uuid)
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    return_token_offsets: bool | None = False
    return_prompt_text: bool | None = None
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    repetition_detection: Any = None
    stream_interval: int | None = Field(default=None, ge=1)

    def fields(self) -> dict[str, Any]:
        """Every field (``messages`` aside) as the emulator reads it: the
        tools as ``model_dump()`` writes them, ``stream_options`` and
        ``structured_outputs`` as plain dicts."""
        out = {name: getattr(self, name) for name in type(self).model_fields}
        del out["messages"]
        out["tools"] = None if self.tools is None else [tool.dump() for tool in self.tools]
        if self.stream_options is not None:
            out["stream_options"] = self.stream_options.model_dump()
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.fields()
        return out

    @model_validator(mode="before")
    @classmethod
    def _before(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = copy.deepcopy(data)
        before_validators(data)
        return data


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


# Built once: validating a body is one call into pydantic-core.
CHAT_BODY: Final[Callable[[Any], ChatCompletionRequest]] = TypeAdapter(
    ChatCompletionRequest
).validate_python
