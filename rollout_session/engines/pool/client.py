"""HTTP exchanges with one worker, and their failure modes (any engine).

`WorkerClient` keeps the keep-alive connections to one worker. `post`
sends a request and maps transport failures onto the error tree: `NotSent` when
the connection could not be made (no byte reached the worker, so another
worker may safely be tried), `UpstreamTimeout` (504) when the worker did not
answer in time, `UpstreamError` (502) for any other transport failure (the
worker may have done the work: never retried), `UpstreamMalformed` (502,
kind ``answer_too_large``) for an answer over ``--max-answer-mb``: it is
read no further and its connection is closed. The pool's dispatch
(`dispatch.py`) decides what to do with them.

Messages of these errors reach agents, so they never name the worker: the
URL and the transport's own words are logged here instead.
"""

from __future__ import annotations

import contextvars
import logging
import ssl
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpcore
import orjson
import trio

from ...errors import UpstreamError, UpstreamMalformed, UpstreamTimeout

__all__ = [
    "ROUTED_WORKER_HEADER",
    "TRANSPORT_ERRORS",
    "AnswerTooLarge",
    "Exchange",
    "NotSent",
    "UpstreamReply",
    "WorkerClient",
    "failure_detail",
    "forwardable_headers",
    "get_json",
    "post",
    "routed_worker",
    "transport_detail",
]

logger = logging.getLogger("rollout_session")

# The worker sgl-model-gateway (smg) routed a request to: its URL as
# registered there (with "@<rank>" for a data-parallel worker).
ROUTED_WORKER_HEADER = b"x-smg-routed-worker-id"
# A URL longer than this is not a gateway's worker id.
_MAX_ROUTED_WORKER_BYTES = 2048
# Not forwarded to the agent: framing and hop-by-hop headers are the proxy's
# own; a content-encoding is never asked for (`accept-encoding: identity`).
_DROPPED_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"content-encoding",
        b"server",
        b"date",
        # A gateway's (below): it names an internal worker, which agents never learn.
        ROUTED_WORKER_HEADER,
    }
)
# Identity: the body is validated and passed on as the worker's bytes.
_CHAT_HEADERS = ((b"content-type", b"application/json"), (b"accept-encoding", b"identity"))
_GET_HEADERS = ((b"accept", b"application/json"), (b"accept-encoding", b"identity"))
# A model card is a few hundred bytes; more is not a model server's answer.
_MAX_CARD_BYTES = 1 << 20
# Transport failures after a connection was made (ConnectError is a
# NetworkError and ConnectTimeout a TimeoutException: caught before these).
TRANSPORT_ERRORS = (
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.ProxyError,
    httpcore.UnsupportedProtocol,
)


def transport_detail(exc: BaseException) -> str:
    """``Type: message`` for a log line or a worker's ``last_error``. An
    error with no message of its own (httpcore's ConnectError for a refused
    TLS certificate, raised from trio's BrokenResourceError) names the
    innermost cause that has one: an operator must read *why*."""
    if str(exc):
        return f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    for _ in range(8):  # a chain, not a loop: bounded all the same
        if cause is None:
            break
        if str(cause):
            return f"{type(exc).__name__} ({type(cause).__name__}: {cause})"
        cause = cause.__cause__ or cause.__context__
    return type(exc).__name__


def failure_detail(exc: BaseException) -> str:
    """An exchange's failure for a worker's ``last_error``: our own error's
    message as it is, a transport failure with its cause (`transport_detail`)."""
    if isinstance(exc, UpstreamError | UpstreamMalformed | UpstreamTimeout):
        return str(exc)
    return transport_detail(exc)


# httpcore reads 64 KiB at a time: a large answer is many reads, each a
# task step of the loop plus h11 and httpcore bookkeeping. Once a read comes
# back full, what follows is asked for up to 1 MiB at a time. Not from the
# first read: a 1 MiB receive buffer is mapped and unmapped per call, which a
# small answer would pay for nothing
# (docs/performance.md#large-reads-from-the-worker). (The `timeout`
# parameters below are httpcore's interface: noqa ASYNC109.)
READ_BYTES = 1 << 20
# Room for a response's status line and headers on top of its body's limit.
_HEAD_BYTES = 64 * 1024


class AnswerTooLarge(Exception):
    """The worker's answer is longer than the caller's limit."""


class _Budget:
    """The bytes an exchange may still read (status line, headers, body)."""

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left


# The running exchange's budget. Charged where the bytes arrive, in the
# network stream: the error then rises through httpcore's own body
# iterators, which end with it (and close the connection), rather than
# being abandoned half-read.
_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "rollout_session_read_budget", default=None
)


class _LargeReadStream(httpcore.AsyncNetworkStream):
    """A network stream that reads up to `READ_BYTES` while data keeps coming
    in pieces at least as large as httpcore asks for, and charges what it
    reads to the running exchange's budget."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._large = False  # the last read was full-sized: more is likely waiting

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        data = await self._stream.read(READ_BYTES if self._large else max_bytes, timeout)
        self._large = len(data) >= max_bytes
        budget = _budget.get()
        if budget is not None:
            budget.left -= len(data)
            if budget.left < 0:
                raise AnswerTooLarge("the answer is over its limit")
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        return _LargeReadStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _LargeReadBackend(httpcore.AsyncNetworkBackend):
    """httpcore's trio backend, its streams wrapped in `_LargeReadStream`."""

    def __init__(self) -> None:
        self._backend = httpcore.TrioBackend()  # the server is one trio loop

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return _LargeReadStream(stream)

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class WorkerClient:
    """Keep-alive HTTP/1.1 connections to one worker, on httpcore directly.

    Not `httpx.AsyncClient`: its layers (URL merging, header models, auth,
    redirects, cookies, exception re-mapping) cost CPU on every request and
    the server uses none of them. Not httpcore's `AsyncConnectionPool`
    either: it rescans every pooled connection twice per request (a
    readability syscall per idle connection, and a count of idle connections
    per idle connection), so its cost grows with the pool
    (docs/performance.md#upstream-client). Here the most recently used idle
    connection is taken and only it is checked: O(1).

    Invariants: at most `max_connections` exchanges in flight, each on its
    own connection; a connection is put back only when its exchange completed
    (HTTP/1.1 state idle), every other one is closed; idle connections are
    ordered oldest first.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int,
        timeout_s: float,
        connect_timeout_s: float,
        keepalive_expiry_s: float = 5.0,  # httpx's default
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls` verifies an ``https`` worker; without it httpcore builds a
        context (loading the CA bundle) for every new connection."""
        self.base_url = base_url.rstrip("/")
        self._origin = httpcore.URL(self.base_url).origin
        # What httpcore's `request` would send (the port only when not the default).
        origin = self._origin
        default = {b"http": 80, b"https": 443}.get(origin.scheme)
        port = origin.port
        self._host = origin.host if port in (None, default) else b"%b:%d" % (origin.host, port)
        self._pool_timeout_s = timeout_s
        self._keepalive_expiry_s = keepalive_expiry_s
        # httpcore applies these per network operation (as httpx did).
        self._extensions: dict[str, Any] = {
            "timeout": {
                "connect": connect_timeout_s,
                "read": timeout_s,
                "write": timeout_s,
                "pool": timeout_s,
            }
        }
        self._tls = tls
        self._backend = _LargeReadBackend()
        self._slots = trio.Semaphore(max_connections)
        self._idle: deque[httpcore.AsyncHTTPConnection] = deque()
        self._urls: dict[str, httpcore.URL] = {}
        self._closed = False

    async def request(
        self,
        method: bytes,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None = None,
        *,
        max_bytes: int,
    ) -> Exchange:
        """One exchange; the whole body is read, up to `max_bytes`. Raises
        httpcore's exceptions, and `AnswerTooLarge` for a longer body (then
        read no further, its connection closed)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpcore.URL(self.base_url + path)
        headers = [(b"Host", self._host), *headers]
        if body is not None:
            headers.append((b"Content-Length", str(len(body)).encode()))
        request = httpcore.Request(
            method, url, headers=headers, content=body, extensions=self._extensions
        )
        await self._acquire_slot()
        try:
            connection = await self._checkout()
            try:
                return await _exchange(connection, request, max_bytes)
            finally:
                # A body left unread leaves the connection mid-exchange: closed.
                await self._checkin(connection)
        finally:
            self._slots.release()

    async def _acquire_slot(self) -> None:
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            with trio.move_on_after(self._pool_timeout_s):
                await self._slots.acquire()
                return
            raise httpcore.PoolTimeout("no connection to the worker became free") from None

    async def _checkout(self) -> httpcore.AsyncHTTPConnection:
        if self._closed:
            raise httpcore.ConnectError("the worker's client is closed")
        idle = self._idle
        # Expiry follows last use, so stale connections gather at the old end.
        while len(idle) > 1 and idle[0].has_expired():
            await self._discard(idle.popleft())
        while idle:
            connection = idle.pop()
            if not connection.has_expired():
                return connection
            await self._discard(connection)
        # Connects on its first request (ConnectError/ConnectTimeout there).
        return httpcore.AsyncHTTPConnection(
            self._origin,
            keepalive_expiry=self._keepalive_expiry_s,
            network_backend=self._backend,
            ssl_context=self._tls,
        )

    async def _checkin(self, connection: httpcore.AsyncHTTPConnection) -> None:
        if connection.is_closed():
            return
        if connection.is_idle() and not self._closed:
            self._idle.append(connection)
            return
        # Cancelled or failed mid-exchange: the connection cannot be reused.
        await self._discard(connection)

    @staticmethod
    async def _discard(connection: httpcore.AsyncHTTPConnection) -> None:
        with trio.CancelScope(shield=True):
            await connection.aclose()

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            await self._discard(self._idle.pop())


@dataclass(slots=True, frozen=True)
class Exchange:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _exchange(
    connection: httpcore.AsyncHTTPConnection, request: httpcore.Request, max_bytes: int
) -> Exchange:
    token = _budget.set(_Budget(max_bytes + _HEAD_BYTES))
    try:
        response = await connection.handle_async_request(request)
        try:
            declared = _declared_length(response.headers)
            if declared is not None and declared > max_bytes:
                raise AnswerTooLarge(f"Content-Length {declared} > {max_bytes}")
            body = await response.aread()
        finally:
            # After an unread or cut body this closes the connection.
            await response.aclose()
    finally:
        _budget.reset(token)
    if len(body) > max_bytes:  # within the head's room, over the body's limit
        raise AnswerTooLarge(f"{len(body)} > {max_bytes}")
    return Exchange(response.status, response.headers, body)


@dataclass(slots=True, frozen=True)
class UpstreamReply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    worker: str  # the pool's worker (a gateway's URL behind one)
    latency_s: float
    # The worker behind a gateway that answered, as the gateway reports it
    # (`ROUTED_WORKER_HEADER`); None without a gateway.
    routed_worker: str | None = None

    @property
    def served_by(self) -> str:
        """The worker that generated the answer: what a turn records."""
        return self.routed_worker or self.worker


class NotSent(Exception):
    """The request never reached the worker (connect refused / timed out)."""


def routed_worker(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The gateway's `ROUTED_WORKER_HEADER`, if it is a plausible worker id.
    A malformed one is logged and ignored: the turn then records the gateway."""
    for name, value in headers:
        if name.lower() != ROUTED_WORKER_HEADER:
            continue
        text = value.decode("ascii", "replace").strip()
        if (
            text
            and len(value) <= _MAX_ROUTED_WORKER_BYTES
            and text.isascii()
            and text.isprintable()
        ):
            return text
        logger.warning(
            "ignoring a malformed %s header: %.80r", ROUTED_WORKER_HEADER.decode(), value
        )
        return None
    return None


def forwardable_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The worker's headers an agent gets, names lowercased (as ASGI sends them)."""
    kept = ((k.lower(), v) for k, v in headers)
    return [(k, v) for k, v in kept if k not in _DROPPED_HEADERS]


async def post(
    client: WorkerClient,
    path: str,
    payload: bytes,
    *,
    session_id: str,
    session_headers: tuple[bytes, ...],
    timeout_s: float,
    max_bytes: int,
) -> UpstreamReply:
    """POST one JSON request to `path`, its session id in each of
    `session_headers` (a router in front keeps the session sticky by them;
    workers ignore them)."""
    url = client.base_url
    session = session_id.encode()
    headers = [*_CHAT_HEADERS, *((name, session) for name in session_headers)]
    started = time.perf_counter()
    try:
        with trio.fail_after(timeout_s):
            response = await client.request(b"POST", path, headers, payload, max_bytes=max_bytes)
    except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
        logger.warning("cannot connect to worker %s: %s", url, transport_detail(exc))
        raise NotSent(f"cannot connect to the worker: {type(exc).__name__}") from None
    except (trio.TooSlowError, httpcore.TimeoutException):
        logger.warning("worker %s did not answer within %g s", url, timeout_s)
        raise UpstreamTimeout(f"the worker did not answer within {timeout_s:g} s") from None
    except TRANSPORT_ERRORS as exc:
        logger.warning("transport error talking to worker %s: %s", url, transport_detail(exc))
        raise UpstreamError(
            f"transport error talking to the worker: {type(exc).__name__}"
        ) from None
    except AnswerTooLarge as exc:
        logger.warning("worker %s answered over --max-answer-mb: %s", url, exc)
        raise UpstreamMalformed(
            f"the worker's answer is larger than --max-answer-mb ({max_bytes / 2**20:g} MB)",
            kind="answer_too_large",
        ) from None
    return UpstreamReply(
        status=response.status,
        headers=forwardable_headers(response.headers),
        body=response.body,
        worker=url,
        latency_s=time.perf_counter() - started,
        routed_worker=routed_worker(response.headers),
    )


async def get_json(client: WorkerClient, path: str) -> dict[str, Any]:
    """A small JSON object a worker serves (a model card); `UpstreamError` otherwise."""
    try:
        response = await client.request(b"GET", path, list(_GET_HEADERS), max_bytes=_MAX_CARD_BYTES)
    except AnswerTooLarge:
        raise UpstreamError(f"{path} answered over {_MAX_CARD_BYTES} bytes") from None
    if response.status != 200:
        raise UpstreamError(f"{path} answered {response.status}")
    try:
        data = orjson.loads(response.body)
    except orjson.JSONDecodeError:
        raise UpstreamError(f"{path} answered something other than JSON") from None
    if not isinstance(data, dict):
        raise UpstreamError(f"{path} answered JSON that is not an object")
    return data
