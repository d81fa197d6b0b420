"""The chat route as bare ASGI, below Quart, and the error rendering both share.

Every agent turn is a ``POST /sessions/{id}/v1/chat/completions``, so that
route is served here: `ChatRoute` wraps the Quart app's ASGI callable and
hands every other request to Quart unchanged. Quart's per-request machinery
(request and app contexts, URL matching, a task per request, werkzeug
headers) costs 0.3-0.7 ms, a third of the server's added latency on a small
turn (docs/benchmarks.md, P2). What Quart did for this route is kept: the API
key, the body limit and timeout, 405 for other methods, the OpenAI error body
for every failure, and a client disconnect cancelling the turn (Quart-Trio's
behaviour: the handler runs in a nursery that a disconnect cancels).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable

import trio
from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGISendCallable,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    HTTPScope,
    Scope,
)

from .context import ServerContext
from .errors import (
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    RequestTooLarge,
    RolloutSessionError,
    Unauthorized,
)
from .streaming import SSE_CONTENT_TYPE, SSE_HEADERS, sse_body
from .turns import run_turn

__all__ = [
    "BODY_TIMEOUT_S",
    "ChatRoute",
    "as_error",
    "bearer",
    "chat_session_id",
    "check_api_key",
]

logger = logging.getLogger("rollout_session")

Headers = list[tuple[bytes, bytes]]
_Response = tuple[int, Headers, bytes]  # status, headers, body

# A client that stops sending its body mid-way must not hold a task forever;
# Quart's default for the other routes, applied here too.
BODY_TIMEOUT_S = 60
_PREFIX = "/sessions/"
_SUFFIX = "/v1/chat/completions"
_JSON = b"application/json"
_SSE_HEADERS: Headers = [
    (b"content-type", SSE_CONTENT_TYPE.encode()),
    *((k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()),
]


def chat_session_id(path: str) -> str | None:
    """The session id if `path` is the chat route (Quart's ``<session_id>``
    rule: one non-empty segment), else None."""
    if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
        return None
    session_id = path[len(_PREFIX) : len(path) - len(_SUFFIX)]
    return session_id if session_id and "/" not in session_id else None


def bearer(api_key: str | None) -> bytes | None:
    """The Authorization header value `check_api_key` expects (None: no key)."""
    return None if api_key is None else f"Bearer {api_key}".encode()


def check_api_key(expected: bytes | None, authorization: bytes) -> None:
    """Raise `Unauthorized` unless `authorization` is `expected`."""
    # Constant-time: the comparison must not leak how much of a guess matched.
    if expected is not None and not hmac.compare_digest(authorization, expected):
        raise Unauthorized("missing or wrong API key (Authorization: Bearer <key>)")


def as_error(exc: Exception) -> RolloutSessionError:
    """The error to answer with for `exc`, logged if it is the server's fault."""
    if not isinstance(exc, RolloutSessionError):
        logger.error("unexpected error handling a request", exc_info=exc)
        return InternalError(f"internal error: {type(exc).__name__}")
    if exc.status_code == 500:
        logger.error("%s: %s", exc.code, exc.message)
    return exc


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    # ASGI header names are lowercase.
    return next((value for key, value in headers if key == name), None)


class ChatRoute:
    """ASGI middleware serving the chat route; everything else goes to `app`."""

    def __init__(self, app: ASGIFramework, ctx: ServerContext) -> None:
        self._app = app
        self._ctx = ctx
        self._expected_auth = bearer(ctx.settings.api_key)

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            session_id = chat_session_id(scope["path"])
            if session_id is not None:
                await self._serve(scope, receive, send, session_id)
                return
        await self._app(scope, receive, send)

    async def _serve(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        session_id: str,
    ) -> None:
        try:
            body = await self._read_request(scope, receive)
        except Exception as exc:  # every failure gets the error body
            await _send(send, _error_response(exc))
            return
        if body is None:
            return  # the agent went away before its request was complete
        async with trio.open_nursery() as nursery:
            # A disconnect cancels everything here, as in Quart-Trio.
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                response = await self._turn(session_id, body)
            except Exception as exc:
                response = _error_response(exc)
            await _send(send, response)
            nursery.cancel_scope.cancel()

    async def _read_request(self, scope: HTTPScope, receive: ASGIReceiveCallable) -> bytes | None:
        if scope["method"] != "POST":
            raise MethodNotAllowed("method not allowed on this route")
        check_api_key(self._expected_auth, _header(scope["headers"], b"authorization") or b"")
        return await self._read_body(scope, receive)

    async def _turn(self, session_id: str, body: bytes) -> _Response:
        # The turn is committed and its slot released when run_turn returns:
        # an agent that goes away while the answer is sent loses nothing.
        outcome = await run_turn(self._ctx, session_id, body)
        reply = outcome.reply
        # Errors (ours, raised above, or the worker's non-200) stay JSON with
        # their status, streaming or not, so SDKs raise the typed exception.
        if reply.status == 200 and outcome.stream is not None:
            events = await self._ctx.offload(len(reply.body), sse_body, reply.body, outcome.stream)
            return 200, list(_SSE_HEADERS), events
        content_type = _header(reply.headers, b"content-type") or _JSON
        headers = [(k, v) for k, v in reply.headers if k != b"content-type"]
        headers.append((b"content-type", content_type))
        return reply.status, headers, reply.body

    async def _read_body(self, scope: HTTPScope, receive: ASGIReceiveCallable) -> bytes | None:
        limit = self._ctx.settings.max_body_bytes
        declared = _header(scope["headers"], b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestTooLarge()
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(BODY_TIMEOUT_S):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None  # http.disconnect
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise RequestTooLarge()
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        raise InvalidRequest(f"the request body did not arrive within {BODY_TIMEOUT_S} s")


async def _send(send: ASGISendCallable, response: _Response) -> None:
    status, headers, body = response
    headers.append((b"content-length", str(len(body)).encode()))
    await send(HTTPResponseStartEvent(type="http.response.start", status=status, headers=headers))
    await send(HTTPResponseBodyEvent(type="http.response.body", body=body, more_body=False))


def _error_response(exc: Exception) -> _Response:
    error = as_error(exc)
    headers = [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    headers.append((b"content-type", _JSON))
    return error.status_code, headers, error.to_body()


async def _cancel_on_disconnect(receive: ASGIReceiveCallable, scope: trio.CancelScope) -> None:
    # After the body, the only message left is the disconnect. It cancels the
    # turn, which cancels its upstream request; nothing is committed.
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
