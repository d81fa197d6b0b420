"""vLLM 0.33.0's error answers, for the emulator's vLLM routes.

Models ``entrypoints/serve/engine/protocol.py`` ``ErrorResponse``
(`error_body`, `VllmError`), ``exceptions.py`` ``VLLMValidationError``
through ``create_error_response`` (`validation_error`), FastAPI's body
decoding (``json_invalid``: `json_body`) and
``entrypoints/serve/exception_handling/handlers/validation.py``
``validation_exception_handler``, which renders a pydantic
``ValidationError`` (`pydantic_error`, `body_error`: ``loc`` cleaned by
``clean_loc_for_param``, ``input`` summarised by
``_summarize_error_input``, at most ten errors, each cut at 1,000
characters, paths and addresses stripped by ``sanitize_message``). What vLLM serves and the
emulator does not model is `not_modelled`: refused, never faked.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

import orjson
from pydantic import ValidationError

from rollout_session.emulator.faults import Reply

__all__ = [
    "VllmError",
    "body_error",
    "error_body",
    "json_body",
    "not_modelled",
    "pydantic_error",
    "require_json",
    "validation_error",
]

_MAX_REPORTED_ERRORS: Final = 10
_MAX_ERROR_INPUT_CHARS: Final = 200
_MAX_ERROR_CHARS: Final = 1000
# sanitize_message's patterns, in its order.
_SANITIZE: Final = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)
# clean_loc_for_param: a bracketed segment is one of pydantic's markers, and
# so is each of _INTERNAL_LOC_MARKERS (pydantic-core's schema kinds).
_BRACKETED: Final = re.compile(r"[\[\](){}]")
_INTERNAL_LOC_MARKERS: Final = frozenset(
    {
        "function-wrap", "function-after", "function-before", "function-plain",
        "json-or-python", "lax-or-strict", "chain", "default", "nullable", "tagged-union",
        "union", "call", "arguments", "is-instance", "is-subclass", "callable", "str", "int",
        "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
        "complex", "none", "nonetype",
    }
)  # fmt: skip


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
    """``_summarize_error_input``: a container described, a long text cut."""
    if isinstance(value, str):
        if len(value) > _MAX_ERROR_INPUT_CHARS:
            return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
        return value
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def clean_loc(loc: tuple[str | int, ...]) -> str:
    """``clean_loc_for_param``: the dotted path without pydantic's markers."""
    parts = [
        str(p)
        for p in loc
        if not (_BRACKETED.search(str(p)) or str(p).lower() in _INTERNAL_LOC_MARKERS)
    ]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def pydantic_error(exc: ValidationError, prefix: tuple[str, ...] = ("body",)) -> VllmError:
    """FastAPI's ``RequestValidationError`` of a pydantic ``ValidationError``
    (its ``loc`` under ``prefix``) through ``validation_exception_handler``."""
    errors = []
    for error in exc.errors(include_url=False):
        item: dict[str, Any] = {
            "type": error["type"],
            "loc": clean_loc((*prefix, *error["loc"])),
            "msg": error["msg"],
            "input": _summarize(error["input"]),
        }
        if "ctx" in error:
            item["ctx"] = error["ctx"]
        errors.append(item)
    return body_error(errors)


def _format(error: Any) -> str:
    """``_format_error``: one error's text, cut at ``_MAX_ERROR_CHARS``."""
    text = str(error)
    if len(text) > _MAX_ERROR_CHARS:
        return text[:_MAX_ERROR_CHARS] + "...[truncated]"
    return text


def _sanitize(message: str) -> str:
    """``exception_handling/utils.py`` ``sanitize_message``: no memory
    addresses, traceback lines or file paths (an echoed input's too)."""
    for pattern, replacement in _SANITIZE:
        message = pattern.sub(replacement, message)
    return message.strip()


def body_error(errors: list[Any]) -> VllmError:
    """``validation_exception_handler``: ``"N validation error(s):\n  {…}"``
    (``param`` the first error's cleaned ``loc``)."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    lines = "".join(f"  {_format(e)}\n" for e in errors[:_MAX_REPORTED_ERRORS])
    if count > _MAX_REPORTED_ERRORS:
        lines += f"  ...and {count - _MAX_REPORTED_ERRORS} more {label}\n"
    first = errors[0]
    param = first["loc"] if isinstance(first, dict) else None
    message = _sanitize(f"{count} validation {label}:\n{lines}")
    return VllmError(message, type_="Bad Request", param=param)


def require_json(content_type: str) -> None:
    """``entrypoints/serve/utils/api_utils.py`` ``validate_json_request``: a
    ``RequestValidationError`` of one plain string."""
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise body_error(["Unsupported Media Type: Only 'application/json' is allowed"])


def json_body(raw: bytes) -> Any:
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
        error = {
            "type": "json_invalid",
            "loc": f"body.{pos}",
            "msg": "JSON decode error",
            "input": _summarize({}),
            "ctx": {"error": reason},
        }
        raise body_error([error]) from None
