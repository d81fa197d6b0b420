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
``N validation error(s):`` and pydantic's error dicts: `generate.body_error`), an ``HTTPException``
its ``{"error": {...}}`` with the status
phrase as type.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from rollout_session.emulator.faults import Reply
from rollout_session.emulator.vllm.generate import Loc, _bool, _Errors, _str, body_error
from rollout_session.emulator.vllm.generate import error_body as vllm_error_body
from rollout_session.emulator.weights import VLLM_PAUSE_MODES, Weights

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


# -- vLLM: FastAPI query and body parameters -----------------------------------------


def _validation(errs: _Errors) -> Reply | None:
    """``validation_exception_handler``'s 400, or None without errors."""
    return body_error(errs.items).reply() if errs.items else None


def _literal(value: Any, loc: Loc, errs: _Errors) -> str | None:
    if value in VLLM_PAUSE_MODES:
        return str(value)
    expected = "'abort', 'wait' or 'keep'"
    errs.add("literal_error", loc, f"Input should be {expected}", value, {"expected": expected})
    return None


async def vllm_pause(weights: Weights, query: Mapping[str, str]) -> Reply:
    """``pause_generation``: ``mode`` and ``clear_cache`` are query parameters."""
    errs = _Errors()
    mode = _literal(query["mode"], ("query", "mode"), errs) if "mode" in query else "abort"
    clear: Any = True
    if "clear_cache" in query:
        clear = _bool(query["clear_cache"], ("query", "clear_cache"), errs)
    refused = _validation(errs)
    if refused is not None:
        return refused
    assert mode is not None
    await weights.vllm_pause(mode, bool(clear))
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
    """``update_weight_version``: ``new_version: Annotated[str, Body(embed=True)]``."""
    errs = _Errors()
    body: Any = None
    if raw.strip():
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            errs.add("json_invalid", ("body", exc.pos), "JSON decode error", {}, {"error": exc.msg})
        except UnicodeDecodeError as exc:
            errs.add("json_invalid", ("body", 0), "JSON decode error", {}, {"error": str(exc)})
    new: Any = None
    if not errs.items:
        if isinstance(body, dict) and "new_version" in body:
            new = _str(body["new_version"], ("body", "new_version"), errs)
        else:
            errs.add("missing", ("body", "new_version"), "Field required", None)
    refused = _validation(errs)
    if refused is not None:
        return refused
    assert isinstance(new, str)
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
