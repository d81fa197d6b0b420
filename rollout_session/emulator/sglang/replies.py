"""SGLang's error replies and the request-field checks its routes share.

Owns the error body of SGLang's native routes (``http_server.py``
``_create_error_response``: `generate_error`), FastAPI's request
validation error as SGLang renders it (``validation_exception_handler``:
flat, type "Bad Request": `validation_error`, `Invalid`), and the checks
``/v1/chat/completions`` and ``/generate`` both make of a field
(`check_priority`, `opt_int`).
"""

from __future__ import annotations

from typing import Any, Final

import orjson
from pydantic import TypeAdapter, ValidationError

from rollout_session.emulator.faults import BadRequest, Reply, error_body

__all__ = ["Invalid", "check_priority", "generate_error", "opt_int", "validation_error"]

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# GenerateReqInput / ChatCompletionRequest ``priority: Optional[int]``, built once.
_PRIORITY: Final[TypeAdapter[int | None]] = TypeAdapter(int | None)
_PRIORITY_RANGE = (
    "priority must be a signed 64-bit integer between -9223372036854775808 and 9223372036854775807"
)


def generate_error(message: str, status: int = 400) -> Reply:
    """The error body of SGLang's native routes (``_create_error_response``)."""
    return Reply(status, orjson.dumps({"error": {"message": message}}))


def validation_error(message: str) -> Reply:
    """FastAPI's request validation error as SGLang renders it (flat, 400)."""
    return Reply(400, error_body(message, type_="Bad Request"))


class Invalid(BadRequest):
    """A field of the wrong type: FastAPI's validation error (flat, type "Bad Request")."""

    def reply(self) -> Reply:
        return validation_error(str(self))


def check_priority(body: dict[str, Any]) -> None:
    """SGLang accepts ``priority`` without --enable-priority-scheduling and ignores
    it (``abort_on_priority_when_disabled`` is off by default); FastAPI reads it
    as ``Optional[int]`` (pydantic, lax), then only the int64 range is checked
    (``TokenizerManager._set_default_priority``)."""
    try:
        value = _PRIORITY.validate_python(body.get("priority"))
    except ValidationError as exc:
        raise Invalid(f"priority: {exc.errors(include_url=False)[0]['msg']}") from None
    if value is not None and not _INT64_MIN <= value <= _INT64_MAX:
        raise BadRequest(_PRIORITY_RANGE)


def opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    """An optional integer field of at least ``minimum`` (None when absent)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{key} must be an integer >= {minimum}")
    return value
