"""SGLang 0.5.23's request bodies as FastAPI reads them, for the emulator.

SGLang's HTTP routes take their bodies as ``srt/managers/io_struct.py``
types, validated by pydantic through FastAPI (lax: ``"true"`` is a
boolean, ``7.0`` an integer): the ``msgspec`` structs of the weight and
session routes through ``srt/utils/msgspec_utils.py``
``msgspec_struct_pydantic_core_schema`` (a typed dict of the struct's
fields, unknown keys ignored, defaults filled; in a union with "an
instance of the struct", whose error the emulator leaves out), and
``GenerateReqInput`` (a dataclass; the emulator reads the fields it
honours). The typed dicts here have those fields' types in declaration
order (``BaseReq``'s ``rid`` and ``http_worker_ipc`` first).

A refused body is FastAPI's ``RequestValidationError``, which SGLang's
``srt/entrypoints/http_server.py`` ``validation_exception_handler`` turns
into a flat 400 ``"Bad Request"`` whose message is ``str(exc)`` followed
by ``exc.errors()``; the emulator's message is the first error's field
and pydantic's own reason (`Invalid`: ``"field: msg"``), and FastAPI's
own for a missing or undecodable required body (`read_struct`).
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal, NotRequired, TypeVar

from pydantic import TypeAdapter, ValidationError
from typing_extensions import TypedDict

from rollout_session.emulator.sglang.replies import Invalid

__all__ = [
    "AbortReq",
    "CloseSessionReqInput",
    "ContinueGenerationReqInput",
    "GenerateReqInput",
    "OpenSessionReqInput",
    "PauseGenerationReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightVersionReqInput",
    "check_generate",
    "lax_true",
    "read_struct",
]

T = TypeVar("T")


class _BaseReq(TypedDict):
    rid: NotRequired[str | None]
    http_worker_ipc: NotRequired[str | None]


class UpdateWeightVersionReqInput(_BaseReq):
    new_version: str
    abort_all_requests: NotRequired[bool]


class UpdateWeightFromDiskReqInput(_BaseReq):
    model_path: str
    load_format: NotRequired[str | None]
    abort_all_requests: NotRequired[bool]
    weight_version: NotRequired[str | None]
    is_async: NotRequired[bool]
    torch_empty_cache: NotRequired[bool]
    keep_pause: NotRequired[bool]
    recapture_cuda_graph: NotRequired[bool]
    token_step: NotRequired[int]
    flush_cache: NotRequired[bool]
    manifest: NotRequired[dict[str, Any] | None]


class PauseGenerationReqInput(_BaseReq):
    mode: NotRequired[Literal["abort", "retract", "in_place"]]


class ContinueGenerationReqInput(_BaseReq):
    torch_empty_cache: NotRequired[bool]


class AbortReq(_BaseReq):
    abort_all: NotRequired[bool]
    finished_reason: NotRequired[dict[str, Any] | None]
    abort_message: NotRequired[str | None]


class OpenSessionReqInput(_BaseReq):
    capacity_of_str_len: int
    session_id: NotRequired[str | None]
    streaming: NotRequired[bool | None]
    timeout: NotRequired[float | None]


class CloseSessionReqInput(_BaseReq):
    session_id: str


class GenerateReqInput(TypedDict):
    """The ``GenerateReqInput`` fields the emulator honours, in declaration order."""

    sampling_params: NotRequired[list[dict[str, Any]] | dict[str, Any] | None]
    return_text_in_logprobs: NotRequired[bool]
    stream: NotRequired[bool]
    return_routed_experts: NotRequired[bool]
    routed_experts_start_len: NotRequired[int]
    session_params: NotRequired[dict[str, Any] | None]
    require_reasoning: NotRequired[bool]
    priority: NotRequired[int | None]
    return_prompt_token_ids: NotRequired[bool]


# Built once: validating a body is one call into pydantic-core.
_ADAPTERS: Final[dict[type[Any], TypeAdapter[Any]]] = {
    struct: TypeAdapter(struct)
    for struct in (
        UpdateWeightVersionReqInput,
        UpdateWeightFromDiskReqInput,
        PauseGenerationReqInput,
        ContinueGenerationReqInput,
        AbortReq,
        OpenSessionReqInput,
        CloseSessionReqInput,
        GenerateReqInput,
    )
}
_BOOL: Final = TypeAdapter(bool)


def _invalid(exc: ValidationError) -> Invalid:
    """The first error as ``"field: reason"`` (``body`` for the body itself)."""
    error = exc.errors(include_url=False)[0]
    field = ".".join(str(p) for p in error["loc"]) or "body"
    return Invalid(f"{field}: {error['msg']}")


def read_struct(raw: bytes, struct: type[T], defaults: dict[str, Any]) -> T:
    """A required ``Body()`` of an ``io_struct`` struct: its fields, the
    missing ones at their ``defaults``; raises `Invalid` for FastAPI's
    refusals (an empty body is "Field required", even where every field has
    a default; a body that is not JSON is its decode error)."""
    if not raw.strip():
        raise Invalid("body: Field required")
    try:
        body: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Invalid(f"body: JSON decode error ({exc})") from None
    try:
        fields = _ADAPTERS[struct].validate_python(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    return {**defaults, **fields}  # type: ignore[return-value]


def check_generate(body: dict[str, Any]) -> None:
    """FastAPI's parse of ``GenerateReqInput`` for the fields the emulator
    honours: raises `Invalid` (the contract gate refuses what pydantic's
    lax reading lets through: ``"true"``, ``7.0``)."""
    try:
        _ADAPTERS[GenerateReqInput].validate_python(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


def lax_true(value: Any) -> bool:
    """``value`` as pydantic reads a ``bool`` field (lax: true, 1, "yes", ...)
    is true; what it refuses is not."""
    try:
        return bool(_BOOL.validate_python(value))
    except ValidationError:
        return False
