"""SGLang 0.5.23's weight-update, pause and abort routes, bodies to answers:
parsed and refused in SGLang's shape, then applied to the emulator's
`Weights` (``weights``, engine-neutral).

SGLang (``srt/entrypoints/http_server.py``; bodies are ``io_struct.py``'s
msgspec structs, read by FastAPI through pydantic:
``utils/msgspec_utils.py`` ``msgspec_struct_pydantic_core_schema``, a typed
dict that ignores unknown keys; a required body: an empty one is refused):

- ``POST /update_weight_version`` (``UpdateWeightVersionReqInput``:
  ``new_version`` required, ``abort_all_requests`` = true):
  ``{"success": true, "message": "Weight version updated to V", "new_version": V}``.
- ``POST /update_weights_from_disk`` (``UpdateWeightFromDiskReqInput``:
  ``model_path`` required, ``load_format`` null (the server's),
  ``abort_all_requests`` false, ``weight_version`` null, ``flush_cache``
  true, ``is_async``, ``torch_empty_cache``, ``keep_pause``,
  ``recapture_cuda_graph`` false, ``token_step`` 0, ``manifest`` null:
  accepted, no effect): ``{"success", "message", "num_paused_requests": 0}``,
  200 or (``success`` false) 400.
- ``POST /pause_generation`` (``PauseGenerationReqInput``: ``mode`` =
  "abort" | "retract" | "in_place", default "abort"):
  ``{"message": "Generation paused successfully.", "status": "ok"}``.
- ``POST /continue_generation`` (``ContinueGenerationReqInput``:
  ``torch_empty_cache`` = true): ``{"message": "Generation continued
  successfully.", "status": "ok"}``.
- ``POST /abort_request`` (``AbortReq``: ``rid`` "", ``abort_all`` false):
  200, empty body.

A refused body is SGLang's validation error (``validation_exception_handler``:
400, ``{"object": "error", "message", "type": "Bad Request", "param": null,
"code": 400}``; the emulator's message names the field and pydantic's reason).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Final

import orjson

from rollout_session.emulator.faults import Reply, error_body
from rollout_session.emulator.weights import SGLANG_PAUSE_MODES, Weights

__all__ = [
    "sglang_abort_request",
    "sglang_continue_generation",
    "sglang_pause_generation",
    "sglang_update_weight_version",
    "sglang_update_weights_from_disk",
]


def _json(payload: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(payload))


# -- SGLang: msgspec structs through pydantic ------------------------------------


class _Refused(Exception):
    """A body FastAPI refuses: SGLang's flat 400 "Bad Request"."""

    def reply(self) -> Reply:
        return Reply(400, error_body(str(self), type_="Bad Request"))


_LAX_TRUE: Final = frozenset({"1", "on", "t", "true", "y", "yes"})
_LAX_FALSE: Final = frozenset({"0", "off", "f", "false", "n", "no"})


def _lax_bool(name: str, v: Any) -> bool:
    """pydantic's lax ``bool``: true/false, 0/1, and their strings."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _LAX_TRUE | _LAX_FALSE:
        return v.strip().lower() in _LAX_TRUE
    raise _Refused(f"{name}: Input should be a valid boolean")


def _lax_int(name: str, v: Any) -> int:
    """pydantic's lax ``int``: ints, integral floats, integer strings."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    raise _Refused(f"{name}: Input should be a valid integer")


def _strict_str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _Refused(f"{name}: Input should be a valid string")
    return v


def _opt_str(name: str, v: Any) -> str | None:
    return None if v is None else _strict_str(name, v)


def _opt_dict(name: str, v: Any) -> dict[str, Any] | None:
    if v is not None and not isinstance(v, dict):
        raise _Refused(f"{name}: Input should be a valid dictionary")
    return v


# field → (reader, default); `_REQUIRED` when the field has none.
_REQUIRED: Final = object()
_BASE_FIELDS: Final[dict[str, tuple[Callable[[str, Any], Any], Any]]] = {
    "rid": (_opt_str, None),
    "http_worker_ipc": (_opt_str, None),
}


def _struct(
    raw: bytes, fields: Mapping[str, tuple[Callable[[str, Any], Any], Any]]
) -> dict[str, Any]:
    """A required ``Body()`` of a ``BaseReq`` subclass: the body must be a
    JSON object; unknown keys are ignored, missing ones take their default."""
    if not raw.strip():
        raise _Refused("body: Field required")
    try:
        body: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Refused(f"body: JSON decode error ({exc})") from None
    if not isinstance(body, dict):
        raise _Refused("body: Input should be a valid dictionary")
    out: dict[str, Any] = {}
    for name, (read, default) in {**_BASE_FIELDS, **fields}.items():
        if name not in body:
            if default is _REQUIRED:
                raise _Refused(f"{name}: Field required")
            out[name] = default
            continue
        value = body[name]
        if value is None and default is None:
            out[name] = None
            continue
        out[name] = read(name, value)
    return out


def _mode(name: str, v: Any) -> str:
    if v not in SGLANG_PAUSE_MODES:
        raise _Refused(f"{name}: Input should be 'abort', 'retract' or 'in_place'")
    return str(v)


_UPDATE_WEIGHT_VERSION: Final = {
    "new_version": (_strict_str, _REQUIRED),
    "abort_all_requests": (_lax_bool, True),
}
_UPDATE_FROM_DISK: Final = {
    "model_path": (_strict_str, _REQUIRED),
    "load_format": (_opt_str, None),
    "abort_all_requests": (_lax_bool, False),
    "weight_version": (_opt_str, None),
    "is_async": (_lax_bool, False),
    "torch_empty_cache": (_lax_bool, False),
    "keep_pause": (_lax_bool, False),
    "recapture_cuda_graph": (_lax_bool, False),
    "token_step": (_lax_int, 0),
    "flush_cache": (_lax_bool, True),
    "manifest": (_opt_dict, None),
}
_PAUSE: Final = {"mode": (_mode, "abort")}
_CONTINUE: Final = {"torch_empty_cache": (_lax_bool, True)}
_ABORT: Final = {
    "abort_all": (_lax_bool, False),
    "finished_reason": (_opt_dict, None),
    "abort_message": (_opt_str, None),
}


def sglang_update_weight_version(weights: Weights, raw: bytes) -> Reply:
    """http_server ``update_weight_version``."""
    try:
        body = _struct(raw, _UPDATE_WEIGHT_VERSION)
    except _Refused as exc:
        return exc.reply()
    new = body["new_version"]
    weights.sglang_update_weight_version(new, body["abort_all_requests"])
    return _json(
        {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
    )


async def sglang_update_weights_from_disk(weights: Weights, raw: bytes) -> Reply:
    """http_server ``update_weights_from_disk``: 200, or 400 when it failed."""
    try:
        body = _struct(raw, _UPDATE_FROM_DISK)
    except _Refused as exc:
        return exc.reply()
    success, message = await weights.sglang_update_from_disk(
        body["model_path"],
        body["load_format"],
        body["abort_all_requests"],
        body["weight_version"],
        body["flush_cache"],
    )
    answer = {"success": success, "message": message, "num_paused_requests": 0}
    return _json(answer, 200 if success else 400)


async def sglang_pause_generation(weights: Weights, raw: bytes) -> Reply:
    """http_server ``pause_generation``."""
    try:
        body = _struct(raw, _PAUSE)
    except _Refused as exc:
        return exc.reply()
    await weights.sglang_pause(body["mode"])
    return _json({"message": "Generation paused successfully.", "status": "ok"})


def sglang_continue_generation(weights: Weights, raw: bytes) -> Reply:
    """http_server ``continue_generation``."""
    try:
        _struct(raw, _CONTINUE)
    except _Refused as exc:
        return exc.reply()
    weights.sglang_continue()
    return _json({"message": "Generation continued successfully.", "status": "ok"})


def sglang_abort_request(weights: Weights, raw: bytes) -> Reply:
    """http_server ``abort_request``: 200 with an empty body."""
    try:
        body = _struct(raw, _ABORT)
    except _Refused as exc:
        return exc.reply()
    weights.sglang_abort_request(body["rid"] or "", body["abort_all"])
    return Reply(200, b"", content_type="text/plain")
