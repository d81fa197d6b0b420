"""How the pool speaks to vLLM workers (`VLLM_WORKERS`).

Admission: ``GET /v1/models`` must list vLLM's model cards (``owned_by``
"vllm"; the first is the served model, its ``root`` the model's path, which
holds the tokenizer, and ``max_model_len`` its context), and the
token-in/token-out route must be on: vLLM answers 403 on
``/inference/v1/generate`` unless started with ``--enable-scale-out``
(entrypoints/scale_out/factories.py ``register_scale_out_api_routers``), so
a worker without it is never admitted. The admission's one-token request is
the circuit's probe too.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import httpcore
import msgspec
import orjson
import trio

from ...errors import UpstreamError, UpstreamMalformed, UpstreamTimeout, WorkerUnfit
from ..pool.client import (
    TRANSPORT_ERRORS,
    NotSent,
    UpstreamReply,
    WorkerClient,
    failure_detail,
    get_json,
    post,
)
from ..pool.dialect import PROBE_SESSION, ModelInfo, Probe, WorkerDialect
from ..scoring import VLLM_SCORING
from .answer import check_vllm_probe

__all__ = [
    "GENERATE_PATH",
    "RENDER_PATH",
    "SAMPLING_DEFAULTS",
    "TOOL_PARSING",
    "TOOL_SKIP_SPECIAL_TOKENS",
    "VLLM_WORKERS",
    "fetch_vllm_model_info",
]

GENERATE_PATH = "/inference/v1/generate"
RENDER_PATH = "/v1/chat/completions/render"
# The launch setting a vLLM worker shows through its rendering: its chat
# route's sampling defaults (`ModelInfo.settings` key; the engine's).
SAMPLING_DEFAULTS = "sampling_defaults"
# And whether its chat route parses tool calls (it was launched with
# ``--enable-auto-tool-choice --tool-call-parser``), and, if so, the
# ``skip_special_tokens`` its parsers' ``adjust_request`` leaves on a tool
# request: vLLM does not publish the parser's name, this much of it shows.
TOOL_PARSING = "tool_parsing"
TOOL_SKIP_SPECIAL_TOKENS = "tool_skip_special_tokens"
ABORT_PATH = "/inference/v1/abort_requests"
# vllm-project/router hashes sessions on X-Session-ID; vLLM passes it to its
# engine (generate/base/serving.py SESSION_ID_HEADER). smg's key as for SGLang.
_SESSION_HEADERS = (b"x-smg-routing-key", b"x-session-id")
# A probe's answer is a few hundred bytes.
_PROBE_BYTES = 1 << 20


def probe_body(model: str) -> bytes:
    """One greedy token after a one-id prompt, as ids only (the cheapest
    exchange that proves the route samples and answers in its shape)."""
    return orjson.dumps(
        {
            "request_id": uuid.uuid4().hex,
            "token_ids": [0],
            "model": model,
            "output_mode": "tokens",
            "stream": False,
            "sampling_params": {"max_tokens": 1, "temperature": 0.0, "logprobs": 0},
        }
    )


def _error_message(body: bytes) -> str:
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return body[:200].decode("utf-8", "replace")
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else body[:200].decode("utf-8", "replace")


async def fetch_vllm_model_info(client: WorkerClient, deadline_s: float) -> ModelInfo:
    """What a vLLM worker serves, within `deadline_s`; `UpstreamError` unless
    it is a vLLM worker whose token-in/token-out route answers."""
    try:
        with trio.fail_after(deadline_s):
            models = await get_json(client, "/v1/models")
            cards = models.get("data")
            if not (
                isinstance(cards, list)
                and cards
                and all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in cards)
            ):
                raise UpstreamError("not a vLLM worker: /v1/models lists no model")
            base = cards[0]
            if base.get("owned_by") != "vllm":
                raise UpstreamError(
                    f"not a vLLM worker: /v1/models says owned_by {base.get('owned_by')!r}"
                )
            reply = await post(
                client,
                GENERATE_PATH,
                probe_body(base["id"]),
                session_id=PROBE_SESSION,
                session_headers=_SESSION_HEADERS,
                timeout_s=deadline_s,
                max_bytes=_PROBE_BYTES,
            )
    except trio.TooSlowError:
        raise UpstreamError(
            f"cannot read model info from the worker: no answer within {deadline_s:g} s"
        ) from None
    except (NotSent, UpstreamTimeout, httpcore.TimeoutException, *TRANSPORT_ERRORS) as exc:
        raise UpstreamError(
            f"cannot read model info from the worker: {failure_detail(exc)}"
        ) from None
    if reply.status == 403:
        raise WorkerUnfit(
            f"{GENERATE_PATH} answered 403 ({_error_message(reply.body)}): start vLLM with "
            "--enable-scale-out"
        )
    if reply.status != 200:
        raise UpstreamError(
            f"{GENERATE_PATH} answered {reply.status}: {_error_message(reply.body)}"
        )
    try:
        check_vllm_probe(reply.body)
    except UpstreamMalformed as exc:
        raise UpstreamError(f"{GENERATE_PATH} answered unlike vLLM: {exc}") from None
    max_len = base.get("max_model_len")
    if not isinstance(max_len, int) or isinstance(max_len, bool):
        max_len = None
    root = base.get("root")
    defaults = await _sampling_defaults(client, base["id"], max_len, deadline_s)
    settings: dict[str, Any] = {} if defaults is None else {SAMPLING_DEFAULTS: defaults}
    settings.update(await _tool_parsing(client, base["id"], deadline_s))
    return ModelInfo(
        model=base["id"],
        tokenizer_path=root if isinstance(root, str) and root else None,
        max_model_len=max_len,
        models=tuple(m["id"] for m in cards),
        settings=settings,
    )


# What a rendered request's SamplingParams leaves out is its default
# (vLLM 0.33.0 sampling_params.py SamplingParams; msgspec omits defaults).
_SAMPLING_PARAMS_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "skip_special_tokens": True,
    }
)


class _Rendered(msgspec.Struct):
    token_ids: list[int]
    sampling_params: dict[str, Any]


_RENDERED = msgspec.json.Decoder(_Rendered)


async def _sampling_defaults(
    client: WorkerClient, model: str, max_model_len: int | None, deadline_s: float
) -> dict[str, Any] | None:
    """The sampling parameters the worker's chat route gives a request that
    sets none, from its own rendering of one (``/v1/chat/completions/render``,
    ``ChatCompletionRequest.to_sampling_params`` over
    ``ModelConfig.get_diff_sampling_param``: the model's generation_config,
    or ``--generation-config`` / ``--override-generation-config`` where the
    worker was launched with them): each key of `_SAMPLING_PARAMS_DEFAULTS`,
    and ``max_new_tokens`` where a default caps ``max_tokens`` below the
    context. None when the render cannot be read (the engine then reads the
    model's files, and says so)."""
    answer = await _render(
        client, {"model": model, "messages": [{"role": "user", "content": "ping"}]}, deadline_s
    )
    if answer is None or answer[0] != 200:
        return None
    try:
        rendered = _RENDERED.decode(answer[1])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    params = rendered.sampling_params
    defaults = {k: params.get(k, v) for k, v in _SAMPLING_PARAMS_DEFAULTS.items()}
    cap = params.get("max_tokens")
    room = None if max_model_len is None else max_model_len - len(rendered.token_ids)
    if isinstance(cap, int) and room is not None and cap < room:
        defaults["max_new_tokens"] = cap
    return defaults


async def _render(
    client: WorkerClient, body: dict[str, Any], deadline_s: float
) -> tuple[int, bytes] | None:
    """The worker's answer to rendering `body` (status, body); None when it
    gave none in time."""
    try:
        with trio.fail_after(deadline_s):
            reply = await post(
                client,
                RENDER_PATH,
                orjson.dumps(body),
                session_id=PROBE_SESSION,
                session_headers=_SESSION_HEADERS,
                timeout_s=deadline_s,
                max_bytes=_PROBE_BYTES,
            )
    except (trio.TooSlowError, NotSent, UpstreamError, UpstreamTimeout, UpstreamMalformed):
        return None
    return reply.status, reply.body


_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}},
}


async def _tool_parsing(client: WorkerClient, model: str, deadline_s: float) -> dict[str, bool]:
    """`TOOL_PARSING` and `TOOL_SKIP_SPECIAL_TOKENS` from the worker's
    rendering of a tool request (`tool_choice` auto): vLLM's chat route
    refuses it without a tool parser (``OnlineRenderer.render_chat``:
    '"auto" tool choice requires --enable-auto-tool-choice and
    --tool-call-parser to be set'). {} when the answer says neither."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "ping"}],
        "tools": [_PROBE_TOOL],
        "tool_choice": "auto",
    }
    answer = await _render(client, body, deadline_s)
    if answer is None:
        return {}
    status, raw = answer
    if status == 400 and "--enable-auto-tool-choice" in _error_message(raw):
        return {TOOL_PARSING: False}
    if status != 200:
        return {}
    try:
        rendered = _RENDERED.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return {}
    skip = rendered.sampling_params.get("skip_special_tokens", True)
    return {TOOL_PARSING: True, TOOL_SKIP_SPECIAL_TOKENS: bool(skip)}


# vLLM 0.33's answer to a request submitted while /pause (abort or wait
# mode) holds: core.py `_reject_add_while_paused`'s retryable RequestError,
# an HTTP 503 (docs/research/vllm-0.33-generate-answer.md §4).
_PAUSED_MESSAGE = "Generation is paused"


def _paused(reply: UpstreamReply) -> bool:
    return reply.status == 503 and _PAUSED_MESSAGE in _error_message(reply.body)


def _abort(request_ids: list[str]) -> list[tuple[str, bytes]]:
    # The token route's engine id is "generate-tokens-<request_id>"
    # (token_in_token_out/serving.py `serve_tokens`); abort_requests takes a
    # list of them (token_in_token_out/api_router.py `abort_requests`).
    ids = [f"generate-tokens-{i}" for i in request_ids]
    return [(ABORT_PATH, orjson.dumps({"request_ids": ids}))]


VLLM_WORKERS = WorkerDialect(
    name="vLLM",
    read_model=fetch_vllm_model_info,
    probe=Probe(GENERATE_PATH, probe_body, check_vllm_probe),
    session_headers=_SESSION_HEADERS,
    abort_requests=_abort,
    scoring=VLLM_SCORING,
    paused=_paused,
    # entrypoints/rl/online/api_router.py `is_paused` (VLLM_SERVER_DEV_MODE).
    pause_status=("/is_paused", lambda answer: answer.get("is_paused")),
    settings_text={
        SAMPLING_DEFAULTS: lambda defaults: f"the chat-route sampling defaults {defaults}",
        TOOL_PARSING: lambda parses: (
            "tool-call parsing (--enable-auto-tool-choice --tool-call-parser)"
            if parses
            else "no tool-call parsing"
        ),
        TOOL_SKIP_SPECIAL_TOKENS: lambda skip: f"skip_special_tokens {skip} on tool requests",
    },
)
