"""vLLM 0.33.0's RL routes (weight version, pause, abort), bodies to answers:
parsed and refused in vLLM's shape, then applied to the emulator's
`Weights` (``weights``, engine-neutral).

vLLM (``entrypoints/rl/online/api_router.py``, registered only with
``VLLM_SERVER_DEV_MODE=1``: ``entrypoints/launchers/api_server/routers.py``):

- ``POST /pause?mode=abort|wait|keep&clear_cache=true``: ``{"status": "paused"}``.
- ``POST /resume``: ``{"status": "resumed"}``; ``GET /is_paused``: ``{"is_paused": bool}``.
- ``POST /update_weight_version`` (``{"new_version": str}``, an embedded
  body field): ``{"success": true, "new_version": V}``.
- ``GET /weight_info``: ``{"weight_version": V}``.
- ``POST /abort_requests`` (``{"request_ids": [...]}``; empty or missing:
  every request): ``{"status": "aborted", "aborted": N}`` (N: the ids
  given, or the requests in flight).

A refused query or body is vLLM's validation error (400 ``"Bad Request"``,
``N validation error(s):`` and pydantic's error dicts of the parameters'
types: `errors.pydantic_error`), an ``HTTPException`` its
``{"error": {...}}`` with the status phrase as type.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Literal

import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from rollout_session.emulator.faults import Reply
from rollout_session.emulator.vllm.errors import (
    VllmError,
    body_error,
    json_body,
    pydantic_error,
)
from rollout_session.emulator.vllm.errors import error_body as vllm_error_body
from rollout_session.emulator.weights import Weights

__all__ = [
    "vllm_abort_requests",
    "vllm_is_paused",
    "vllm_pause",
    "vllm_resume",
    "vllm_update_weight_version",
    "vllm_weight_info",
]


def _json(payload: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(payload))


class _PauseQuery(BaseModel):
    """``pause_generation``'s query parameters (each a FastAPI ``Query()``)."""

    mode: Literal["abort", "wait", "keep"] = "abort"  # PauseMode (weights.VLLM_PAUSE_MODES)
    clear_cache: bool = True


# Built once: validating a request is one call into pydantic-core.
_PAUSE_QUERY: Final = TypeAdapter(_PauseQuery).validate_python
_NEW_VERSION: Final = TypeAdapter(str).validate_python


async def vllm_pause(weights: Weights, query: Mapping[str, str]) -> Reply:
    """``pause_generation``: ``mode`` and ``clear_cache`` are query parameters."""
    try:
        params = _PAUSE_QUERY(query)
    except ValidationError as exc:
        return pydantic_error(exc, ("query",)).reply()
    await weights.vllm_pause(params.mode, params.clear_cache)
    return _json({"status": "paused"})


def vllm_resume(weights: Weights) -> Reply:
    weights.vllm_resume()
    return _json({"status": "resumed"})


def vllm_is_paused(weights: Weights) -> Reply:
    return _json({"is_paused": weights.paused})


def vllm_weight_info(weights: Weights) -> Reply:
    """``weight_info``: ``get_weight_version`` (the engine core's label)."""
    return _json({"weight_version": weights.version})


def vllm_update_weight_version(weights: Weights, raw: bytes) -> Reply:
    """``update_weight_version``: ``new_version: Annotated[str, Body(embed=True)]``
    (FastAPI reads the key of a JSON object; anything else has none)."""
    try:
        body: Any = json_body(raw) if raw.strip() else None
    except VllmError as exc:
        return exc.reply()
    if not (isinstance(body, dict) and "new_version" in body):
        # FastAPI's get_missing_field_error: no input to echo.
        missing = {"type": "missing", "loc": "body.new_version", "msg": "Field required"}
        return body_error([{**missing, "input": "None"}]).reply()
    try:
        new = _NEW_VERSION(body["new_version"])
    except ValidationError as exc:
        return pydantic_error(exc, ("body", "new_version")).reply()
    weights.vllm_update_weight_version(new)
    return _json({"success": True, "new_version": new})


def vllm_abort_requests(weights: Weights, raw: bytes) -> Reply:
    """The RL router's ``abort_requests``: the ids given (external: the
    engine ids ``generate-tokens-<id>``), or every request in flight."""
    try:
        body: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Reply(400, vllm_error_body("Invalid JSON format", "Bad Request", 400))
    if not isinstance(body, dict):
        return Reply(400, vllm_error_body("Request body must be a JSON object", "Bad Request", 400))
    ids = body.get("request_ids")
    if ids:
        wanted = [ids] if isinstance(ids, str) else [i for i in ids if isinstance(i, str)]
        weights.abort_keys(wanted, "abort_requests")
        count = 1 if isinstance(ids, str) else len(ids)
    else:
        runs = weights.runs()
        count = len(runs)
        weights.abort(runs, "abort_requests")
    return _json({"status": "aborted", "aborted": count})
