"""One HTTP exchange with one SGLang worker, and its failure modes.

`post_chat` sends a turn and maps transport failures onto the error tree:
`NotSent` when the connection could not be made (no byte reached the worker,
so another worker may safely be tried), `UpstreamTimeout` (504) when the
worker did not answer in time, `UpstreamError` (502) for any other transport
failure (the worker may have done the work: never retried). The worker pool
(`workers.py`) decides what to do with them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import trio

from .errors import UpstreamError, UpstreamTimeout

__all__ = [
    "ModelInfo",
    "NotSent",
    "UpstreamReply",
    "fetch_model_info",
    "forwardable_headers",
    "post_chat",
]

# Not forwarded to the agent: framing and hop-by-hop headers are the proxy's
# own; httpx already decoded any content-encoding.
_DROPPED_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "server",
        "date",
    }
)


@dataclass(slots=True, frozen=True)
class UpstreamReply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    worker: str
    latency_s: float


@dataclass(slots=True, frozen=True)
class ModelInfo:
    model: str
    tokenizer_path: str | None
    max_model_len: int | None


class NotSent(Exception):
    """The request never reached the worker (connect refused / timed out)."""


def forwardable_headers(headers: httpx.Headers) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.multi_items() if k.lower() not in _DROPPED_HEADERS]


async def post_chat(
    client: httpx.AsyncClient, url: str, session_id: str, payload: bytes, timeout_s: float
) -> UpstreamReply:
    headers = {
        "content-type": "application/json",
        # Keeps an sgl-model-gateway upstream sticky too; SGLang ignores it.
        "x-smg-routing-key": session_id,
    }
    started = time.perf_counter()
    try:
        with trio.fail_after(timeout_s):
            response = await client.post("/v1/chat/completions", content=payload, headers=headers)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise NotSent(f"cannot connect to worker {url}: {type(exc).__name__}: {exc}") from None
    except (trio.TooSlowError, httpx.TimeoutException):
        raise UpstreamTimeout(f"worker {url} did not answer within {timeout_s:g} s") from None
    except httpx.TransportError as exc:
        raise UpstreamError(
            f"transport error talking to worker {url}: {type(exc).__name__}: {exc}"
        ) from None
    return UpstreamReply(
        status=response.status_code,
        headers=forwardable_headers(response.headers),
        body=response.content,
        worker=url,
        latency_s=time.perf_counter() - started,
    )


async def _get_json(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    response = await client.get(path)
    response.raise_for_status()
    data = orjson.loads(response.content)
    return data if isinstance(data, dict) else {}


async def fetch_model_info(client: httpx.AsyncClient) -> ModelInfo:
    """What a worker serves: SGLang's `/get_model_info` and `/v1/models`."""
    try:
        info = await _get_json(client, "/get_model_info")
        models = await _get_json(client, "/v1/models")
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        raise UpstreamError(f"cannot read model info from the worker: {exc}") from None
    data = models.get("data") or [{}]
    max_len = data[0].get("max_model_len")
    return ModelInfo(
        # The served name (SGLang's --served-model-name) is what agents send.
        model=str(data[0].get("id") or info.get("model_path") or "unknown"),
        tokenizer_path=info.get("tokenizer_path"),
        max_model_len=max_len if isinstance(max_len, int) else None,
    )
