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
"code": 400}``; the emulator's message names the field and pydantic's reason:
`io_struct`, whose typed dicts pydantic validates).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from rollout_session.emulator.faults import Reply
from rollout_session.emulator.sglang.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightVersionReqInput,
    read_struct,
)
from rollout_session.emulator.sglang.replies import Invalid
from rollout_session.emulator.weights import Weights

__all__ = [
    "sglang_abort_request",
    "sglang_continue_generation",
    "sglang_pause_generation",
    "sglang_update_weight_version",
    "sglang_update_weights_from_disk",
]


def _json(payload: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(payload))


# Each struct's defaults (io_struct.py), BaseReq's first.
_BASE: Final = {"rid": None, "http_worker_ipc": None}
_UPDATE_WEIGHT_VERSION: Final = {**_BASE, "abort_all_requests": True}
_UPDATE_FROM_DISK: Final = {
    **_BASE,
    "load_format": None,
    "abort_all_requests": False,
    "weight_version": None,
    "is_async": False,
    "torch_empty_cache": False,
    "keep_pause": False,
    "recapture_cuda_graph": False,
    "token_step": 0,
    "flush_cache": True,
    "manifest": None,
}
_PAUSE: Final = {**_BASE, "mode": "abort"}
_CONTINUE: Final = {**_BASE, "torch_empty_cache": True}
_ABORT: Final = {**_BASE, "abort_all": False, "finished_reason": None, "abort_message": None}


def sglang_update_weight_version(weights: Weights, raw: bytes) -> Reply:
    """http_server ``update_weight_version``."""
    try:
        body = read_struct(raw, UpdateWeightVersionReqInput, _UPDATE_WEIGHT_VERSION)
    except Invalid as exc:
        return exc.reply()
    new = body["new_version"]
    weights.sglang_update_weight_version(new, body["abort_all_requests"])
    return _json(
        {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
    )


async def sglang_update_weights_from_disk(weights: Weights, raw: bytes) -> Reply:
    """http_server ``update_weights_from_disk``: 200, or 400 when it failed."""
    try:
        body = read_struct(raw, UpdateWeightFromDiskReqInput, _UPDATE_FROM_DISK)
    except Invalid as exc:
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
        body = read_struct(raw, PauseGenerationReqInput, _PAUSE)
    except Invalid as exc:
        return exc.reply()
    await weights.sglang_pause(body["mode"])
    return _json({"message": "Generation paused successfully.", "status": "ok"})


def sglang_continue_generation(weights: Weights, raw: bytes) -> Reply:
    """http_server ``continue_generation``."""
    try:
        read_struct(raw, ContinueGenerationReqInput, _CONTINUE)
    except Invalid as exc:
        return exc.reply()
    weights.sglang_continue()
    return _json({"message": "Generation continued successfully.", "status": "ok"})


def sglang_abort_request(weights: Weights, raw: bytes) -> Reply:
    """http_server ``abort_request``: 200 with an empty body."""
    try:
        body = read_struct(raw, AbortReq, _ABORT)
    except Invalid as exc:
        return exc.reply()
    weights.sglang_abort_request(body["rid"] or "", body["abort_all"])
    return Reply(200, b"", content_type="text/plain")
