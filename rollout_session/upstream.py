"""Talking to SGLang workers: one httpx client per worker, placement, errors.

`Upstream` is the interface the turn path uses; `WorkerPool` implements it.
A session is pinned to a worker on its first turn (the healthy worker with the
fewest pinned sessions, ties broken by fewest in-flight requests) and stays
there, so the worker's radix cache holds its prefix.

Transport failures map to the error tree: a timeout (ours or httpx's) is
`UpstreamTimeout` (504), any other transport error `UpstreamError` (502).
Nothing here touches trajectories.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import orjson
import trio

from .errors import NoHealthyWorker, UpstreamError, UpstreamTimeout

__all__ = ["ModelInfo", "Upstream", "UpstreamReply", "Worker", "WorkerPool"]

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


class Upstream(Protocol):
    """What the turn path needs from the workers."""

    def pick(self, pinned: str | None) -> Worker:
        """The worker for a session pinned to `pinned` (re-pinned if it is gone)."""
        ...

    async def send(self, worker: Worker, session_id: str, payload: bytes) -> UpstreamReply:
        """Send one turn's request body to `worker`."""
        ...

    def release_session(self, worker: str | None) -> None:
        """A session pinned to `worker` is gone."""
        ...

    def counts(self) -> tuple[int, int]:
        """(healthy, total) workers."""
        ...

    async def model_info(self) -> ModelInfo: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class Worker:
    url: str
    client: httpx.AsyncClient
    healthy: bool = True
    active_sessions: int = 0
    inflight: int = 0
    consecutive_failures: int = 0
    last_checked_at: float | None = None


@dataclass
class WorkerPool:
    """Sticky, least-loaded placement over a set of workers."""

    timeout_s: float
    connect_timeout_s: float
    max_connections: int
    workers: dict[str, Worker] = field(default_factory=dict)

    def add(self, url: str) -> Worker:
        client = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=self.max_connections,
                max_keepalive_connections=self.max_connections,
            ),
        )
        worker = self.workers[url] = Worker(url=url, client=client)
        return worker

    async def aclose(self) -> None:
        for worker in self.workers.values():
            await worker.client.aclose()

    def counts(self) -> tuple[int, int]:
        return sum(w.healthy for w in self.workers.values()), len(self.workers)

    def pick(self, pinned: str | None) -> Worker:
        current = self.workers.get(pinned) if pinned else None
        if current is not None and current.healthy:
            return current
        candidates = [w for w in self.workers.values() if w.healthy]
        if not candidates:
            raise NoHealthyWorker("no healthy worker is available")
        best = min(candidates, key=lambda w: (w.active_sessions, w.inflight))
        # Re-pin: the old worker loses the session, the new one gains it.
        if current is not None:
            current.active_sessions -= 1
        best.active_sessions += 1
        return best

    def release_session(self, worker: str | None) -> None:
        pinned = self.workers.get(worker) if worker else None
        if pinned is not None:
            pinned.active_sessions -= 1

    async def send(self, chosen: Worker, session_id: str, payload: bytes) -> UpstreamReply:
        headers = {
            "content-type": "application/json",
            # Keeps an sgl-model-gateway upstream sticky too; SGLang ignores it.
            "x-smg-routing-key": session_id,
        }
        started = time.perf_counter()
        chosen.inflight += 1
        try:
            with trio.fail_after(self.timeout_s):
                response = await chosen.client.post(
                    "/v1/chat/completions", content=payload, headers=headers
                )
        except (trio.TooSlowError, httpx.TimeoutException):
            raise UpstreamTimeout(
                f"worker {chosen.url} did not answer within {self.timeout_s:g} s"
            ) from None
        except httpx.TransportError as exc:
            raise UpstreamError(
                f"transport error talking to worker {chosen.url}: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            chosen.inflight -= 1
        return UpstreamReply(
            status=response.status_code,
            headers=forwardable_headers(response.headers),
            body=response.content,
            worker=chosen.url,
            latency_s=time.perf_counter() - started,
        )

    async def model_info(self) -> ModelInfo:
        """Ask the first worker what it serves (SGLang `/get_model_info`)."""
        if not self.workers:
            raise NoHealthyWorker("no worker configured")
        client = next(iter(self.workers.values())).client
        try:
            info = await _get_json(client, "/get_model_info")
            models = await _get_json(client, "/v1/models")
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            raise UpstreamError(f"cannot read model info from the worker: {exc}") from None
        data = models.get("data") or [{}]
        max_len = data[0].get("max_model_len")
        return ModelInfo(
            model=str(info.get("model_path") or data[0].get("id") or "unknown"),
            tokenizer_path=info.get("tokenizer_path"),
            max_model_len=max_len if isinstance(max_len, int) else None,
        )


async def _get_json(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    response = await client.get(path)
    response.raise_for_status()
    data = orjson.loads(response.content)
    return data if isinstance(data, dict) else {}


def forwardable_headers(headers: httpx.Headers) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.multi_items() if k.lower() not in _DROPPED_HEADERS]
