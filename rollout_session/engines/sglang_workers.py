"""What both SGLang engines know of an SGLang worker beyond their own route:
how its admission check reads the served model, which header names a
session to smg in front of it, how an in-flight request is aborted, and how
it scores a token sequence. Each SGLang engine adds the one-token probe of
its own route (`sglang_dialect`): a worker launched for one route may not
serve the other (``--skip-tokenizer-init`` has no chat route).

Facts from SGLang 0.5.23 (``srt/entrypoints/http_server.py``):
``get_model_info`` (``model_path``, ``tokenizer_path``, ``is_generation``),
the OpenAI ``/v1/models`` list (``max_model_len``), ``server_info`` (the
resolved server args by field name, ``build_server_info`` →
``ServerArgs.resolved_dict``: ``tool_call_parser``, ``reasoning_parser``,
``skip_tokenizer_init``), ``abort_request`` (``io_struct.AbortReq``: one
``rid``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import httpcore
import orjson
import trio

from ..errors import UpstreamError, UpstreamMalformed, UpstreamTimeout
from .pool.client import TRANSPORT_ERRORS, NotSent, WorkerClient, failure_detail, get_json, post
from .pool.dialect import PROBE_SESSION, ModelInfo, Probe, WorkerDialect
from .scoring import SGLANG_SCORING

__all__ = [
    "LAUNCH_SETTINGS",
    "PARSE_ROUTES",
    "fetch_model_info",
    "sglang_dialect",
    "sglang_setting",
]

# The launch settings an engine depends on, as /server_info names them
# (the same names as this server's flags): the parsers that parse on the
# worker, and whether it has a tokenizer (``--skip-tokenizer-init``: ids out,
# no text, no chat route).
LAUNCH_SETTINGS = ("tool_call_parser", "reasoning_parser", "skip_tokenizer_init")

# The parser names SGLang renames at launch (srt/arg_groups/serving_hook.py
# handle_deprecated_args): a worker launched with ``qwen25`` runs, and
# publishes, ``qwen``.
_RENAMED_TOOL_CALL_PARSERS = {"qwen25": "qwen", "glm45": "glm"}


def sglang_setting(name: str, value: Any) -> Any:
    """A launch setting as an SGLang worker given `value` runs it (its new
    name for a deprecated parser name), so a flag and a worker compare alike."""
    if name == "tool_call_parser" and isinstance(value, str):
        return _RENAMED_TOOL_CALL_PARSERS.get(value, value)
    return value


async def fetch_model_info(client: WorkerClient, deadline_s: float) -> ModelInfo:
    """What a worker serves, from SGLang's `/get_model_info` and `/v1/models`,
    both within `deadline_s` (a worker that accepts and never answers must
    not hold start-up for the chat timeout). `UpstreamError` unless both are
    SGLang's answers for a generation model."""
    try:
        with trio.fail_after(deadline_s):
            info = await get_json(client, "/get_model_info")
            models = await get_json(client, "/v1/models")
    except trio.TooSlowError:
        raise UpstreamError(
            f"cannot read model info from the worker: no answer within {deadline_s:g} s"
        ) from None
    except (UpstreamError, httpcore.TimeoutException, *TRANSPORT_ERRORS) as exc:
        raise UpstreamError(
            f"cannot read model info from the worker: {failure_detail(exc)}"
        ) from None
    model_path = info.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        raise UpstreamError("not an SGLang worker: /get_model_info has no model_path")
    if info.get("is_generation") is not True:
        raise UpstreamError("not an SGLang generation model: /get_model_info is_generation")
    data = models.get("data")
    if not (
        isinstance(data, list)
        and data
        and all(isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"] for m in data)
    ):
        raise UpstreamError("not an SGLang worker: /v1/models lists no model")
    max_len = data[0].get("max_model_len")
    if not isinstance(max_len, int) or isinstance(max_len, bool):
        max_len = None
    tokenizer_path = info.get("tokenizer_path")
    return ModelInfo(
        # The served name (SGLang's --served-model-name) is what agents send.
        model=data[0]["id"],
        tokenizer_path=tokenizer_path if isinstance(tokenizer_path, str) else None,
        max_model_len=max_len,
        models=tuple(m["id"] for m in data),
        settings=await _launch_settings(client, deadline_s),
    )


async def _launch_settings(client: WorkerClient, deadline_s: float) -> dict[str, object]:
    """The worker's `LAUNCH_SETTINGS` from its /server_info; {} where it
    publishes none (a gateway in front, an older SGLang): nothing then is
    compared, and this server's flags are taken as the workers' own."""
    try:
        with trio.fail_after(deadline_s):
            info = await get_json(client, "/server_info")
    except (trio.TooSlowError, UpstreamError, httpcore.TimeoutException, *TRANSPORT_ERRORS):
        return {}
    settings: dict[str, object] = {}
    for name in LAUNCH_SETTINGS:
        value = info.get(name)
        if name == "skip_tokenizer_init":
            if isinstance(value, bool):
                settings[name] = value
        elif name in info and (value is None or isinstance(value, str)):
            settings[name] = sglang_setting(name, value)
    return settings


def _abort(rids: list[str]) -> list[tuple[str, bytes]]:
    # AbortReq takes one rid (io_struct.AbortReq; http_server.abort_request).
    return [("/abort_request", orjson.dumps({"rid": rid})) for rid in rids]


# Whether a worker serves SGLang's parse routes (`ModelInfo.settings` key):
# a gateway in front may route /generate but not them (smg answers 404).
PARSE_ROUTES = "parse_routes"


async def _parse_routes(client: WorkerClient, deadline_s: float) -> dict[str, object]:
    """`PARSE_ROUTES` from the answer to an empty ``/parse_function_call``:
    SGLang refuses the body (400, ``validation_exception_handler``), a
    server without the route answers 404; {} when neither says."""
    try:
        reply = await post(
            client,
            "/parse_function_call",
            b"{}",
            session_id=PROBE_SESSION,
            session_headers=(),
            timeout_s=deadline_s,
            max_bytes=1 << 16,
        )
    except (NotSent, UpstreamError, UpstreamTimeout, UpstreamMalformed):
        return {}
    status = reply.status
    if status == 404:
        return {PARSE_ROUTES: False}
    return {PARSE_ROUTES: True} if status in (400, 422) else {}


async def _fetch_with_parse_routes(client: WorkerClient, deadline_s: float) -> ModelInfo:
    info = await fetch_model_info(client, deadline_s)
    settings = {**info.settings, **await _parse_routes(client, deadline_s)}
    return dataclasses.replace(info, settings=settings)


# How SGLang's launch settings that are no flag read in a refusal.
_SETTINGS_TEXT: Mapping[str, Callable[[Any], str]] = MappingProxyType(
    {
        PARSE_ROUTES: lambda served: (
            "SGLang's parse routes (/separate_reasoning, /parse_function_call)"
            if served
            else "no parse routes (a gateway in front that does not route them, as smg)"
        )
    }
)


def sglang_dialect(probe: Probe, *, parses: bool = False) -> WorkerDialect:
    """SGLang workers, probed on an engine's own route; with `parses`, whether
    they serve the parse routes is read too (`PARSE_ROUTES`)."""
    return WorkerDialect(
        name="SGLang",
        read_model=_fetch_with_parse_routes if parses else fetch_model_info,
        settings_text=_SETTINGS_TEXT,
        probe=probe,
        # sgl-model-gateway's routing key; SGLang itself ignores it.
        session_headers=(b"x-smg-routing-key",),
        abort_requests=_abort,
        scoring=SGLANG_SCORING,
    )
