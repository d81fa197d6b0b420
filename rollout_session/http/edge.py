"""The HTTP edge: what every request meets before a route handler runs.

`HttpEdge` is the ASGI callable in front of the Quart app. For every route,
Quart's and the fast chat route alike, it owns:

- **the route**: the path below the ASGI ``root_path`` (stripped as Quart
  strips it); a root model route naming a session (``session_routing``)
  becomes that session's route, for everything after; then the fast route,
  then Quart's URL map; an unknown path is 404 ``not_found`` (naming the
  model routes for a ``/v1/`` path), another method 405
  ``method_not_allowed`` (with ``Allow``);
- **the request's framing**: a request carrying both ``Content-Length`` and
  ``Transfer-Encoding`` is refused (400) and its connection closed after its
  chunked body, with nothing after it read (RFC 9112 §6.1: behind a proxy
  that framed it by its length, the rest would be read here as a second,
  smuggled request);
- **the API key**: ``Authorization: Bearer <key>`` (the scheme in any case),
  or ``x-api-key: <key>`` (Anthropic's SDKs send that), checked by the
  app's `authorize` (`auth.Gate`: which key reaches which route) before
  the route is matched, so an unknown path is 401 too;
- **the request body**: read whole before any handler runs, up to the body
  limit (413 ``request_too_large``) and within `BODY_TIMEOUT_S` (400); on a
  fast route, what it holds is checked before the route parses it
  (`check_body`: the app's ``turn.request.count_items``, 400);
- **error rendering**: every failure as the OpenAI error body of
  `errors.py` (`error_response`, which Quart's error handler uses too), or
  on a fast route of another protocol in its shape (`FastRoute.render_error`),
  never a stack trace.

Drain or close. An HTTP/1.1 connection carries the next request only once
this one's body has been read off it: hypercorn recycles a connection only if
the request was complete when the response ended. An error answered before
the body arrived (clients send headers, then the body) left it unread, and
the next request on the connection stalled. So every request's body is read
before anything answers it, an early error's included (drained: read and
dropped, with the same bounds); a body that cannot be read (over the limit,
too slow) gets its answer with ``Connection: close``, and hypercorn closes
the connection after it.

Keep-alive after the answer: the last body message must not be cancelled,
or hypercorn never makes the connection idle; `serving` shields it for every
app it serves (see there).

The fast route exists for speed: every agent turn is a chat request, and
Quart's per-request machinery (request and app contexts, a task, werkzeug
headers) would cost more than the rest of the edge together. It is served
here, with Quart-Trio's behaviour kept: a client disconnect cancels the
handler.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import trio
from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    HTTPScope,
    Scope,
)
from werkzeug.exceptions import HTTPException, NotFound
from werkzeug.exceptions import MethodNotAllowed as WerkzeugMethodNotAllowed
from werkzeug.routing import MapAdapter, RequestRedirect

from ..errors import (
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    RequestTooLarge,
    RolloutSessionError,
    RouteNotFound,
)
from ..session.session import SESSION_ID

if TYPE_CHECKING:
    from .session_routing import SessionRouting

__all__ = [
    "BODY_TIMEOUT_S",
    "FastRoute",
    "Headers",
    "HttpEdge",
    "RawResponse",
    "Redirect",
    "ambiguous_framing",
    "as_error",
    "error_response",
    "json_answer",
    "replay",
    "route_path",
    "session_route",
]

logger = logging.getLogger("rollout_session")

Headers = list[tuple[bytes, bytes]]

# A client that stops sending its body mid-way must not hold a task forever.
BODY_TIMEOUT_S = 60
_JSON = b"application/json"
_CLOSE = (b"connection", b"close")


class RawResponse(NamedTuple):
    """A complete response; `send_response` adds its content-length."""

    status: int
    headers: Headers
    body: bytes


@dataclass(frozen=True, slots=True)
class FastRoute:
    """A route served by the edge itself, below Quart.

    `match` maps a path to the handler's argument (None: not this route);
    `handle` gets that argument and the whole body.
    """

    method: str
    match: Callable[[str], str | None]
    handle: Callable[[str, bytes], Awaitable[RawResponse]]
    # How this route's protocol renders errors (None: the OpenAI error body),
    # and on which paths (None: those `match` accepts): the edge's own
    # refusals there (401, 405, 413 …) take that shape too.
    render_error: Callable[[Exception], RawResponse] | None = None
    error_paths: Callable[[str], bool] | None = None


def route_path(scope: HTTPScope) -> str | None:
    """The path the routes see: below ``root_path``, None if outside it.

    Quart's rule (``quart.asgi._normalise_path``), which follows the ASGI
    spec: `path` includes `root_path`; a path that does not start with it, or
    is exactly it, matches no route.
    """
    path = scope["path"]
    root = scope.get("root_path", "")
    if not root:
        return path
    if path == root or not path.startswith(root):
        return None
    return path[len(root) :]


def as_error(exc: Exception) -> RolloutSessionError:
    """The error to answer with for `exc`, logged if it is the server's fault."""
    if isinstance(exc, HTTPException):  # raised by Quart or werkzeug in a handler
        return _from_http_exception(exc)
    if not isinstance(exc, RolloutSessionError):
        logger.error("unexpected error handling a request", exc_info=exc)
        return InternalError(f"internal error: {type(exc).__name__}")
    if exc.status_code == 500:
        logger.error("%s: %s", exc.code, exc.message)
    return exc


def error_response(
    exc: Exception, body: Callable[[RolloutSessionError], bytes] | None = None
) -> RawResponse:
    """`exc` with its status and headers, as the OpenAI error body, or as
    `body` renders it (another protocol's error shape)."""
    error = as_error(exc)
    headers = [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    headers.append((b"content-type", _JSON))
    return RawResponse(error.status_code, headers, error.to_body() if body is None else body(error))


def json_answer(status: int, body: bytes) -> RawResponse:
    """A fast route's JSON answer."""
    return RawResponse(status, [(b"content-type", _JSON)], body)


_SESSIONS = "/sessions/"


def session_route(suffix: str) -> Callable[[str], str | None]:
    """A fast route's `match` for ``/sessions/{id}{suffix}``: the session id
    (Quart's ``<session_id>`` rule: one non-empty segment), else None."""

    def session_id(path: str) -> str | None:
        if not (path.startswith(_SESSIONS) and path.endswith(suffix)):
            return None
        found = path[len(_SESSIONS) : len(path) - len(suffix)]
        return found if found and "/" not in found else None

    return session_id


def _from_http_exception(exc: HTTPException) -> RolloutSessionError:
    if exc.code == 404:
        return RouteNotFound("no such route")
    if exc.code == 405:
        return MethodNotAllowed("method not allowed on this route")
    if exc.code == 413:
        return RequestTooLarge()
    return InvalidRequest(exc.description or "bad request")


async def send_response(send: ASGISendCallable, response: RawResponse) -> None:
    status, headers, body = response
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send(HTTPResponseStartEvent(type="http.response.start", status=status, headers=headers))
    await send(HTTPResponseBodyEvent(type="http.response.body", body=body, more_body=False))


class _ClientGone(Exception):
    """The client disconnected before its request was complete."""


# A fleet's shard: (session id, path as asked, query) → 307 to the shard
# that owns the session, or None to serve it here (`fleet.Fleet.redirect`).
Redirect = Callable[[str, str, bytes], RawResponse | None]


class HttpEdge:
    """ASGI middleware: the edge for every request, then the fast route or `app`.

    `app` is Quart's ASGI callable; `routes` its URL map, bound.
    `authorize` (method, path below the root path or None, the
    ``Authorization`` header, the ``x-api-key`` header) raises the error to answer with when the
    request's key does not reach its route; None: no route needs a key.
    `check_body` raises the error to answer a fast route's body with before
    the route parses it (what it holds: too many messages, ...).
    """

    def __init__(
        self,
        app: ASGIFramework,
        *,
        routes: MapAdapter,
        fast_routes: Sequence[FastRoute],
        authorize: Callable[[str, str | None, bytes, bytes], None] | None,
        max_body_bytes: int,
        sessions: SessionRouting | None = None,
        redirect: Redirect | None = None,
        check_body: Callable[[bytes], None] | None = None,
    ) -> None:
        self._app = app
        self._check_body = check_body
        self._redirect = redirect
        self._routes = routes
        self._fast = tuple(fast_routes)
        self._authorize = authorize
        self._limit = max_body_bytes
        self._sessions = sessions

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":  # lifespan (Quart's startup, shutdown); no websockets
            await self._app(scope, receive, send)
            return
        if ambiguous_framing(scope["headers"]):
            refusal = InvalidRequest(
                "a request may not carry both Content-Length and Transfer-Encoding"
            )
            await self._refuse(scope, receive, send, refusal, close=True)
            return
        # The path as asked, for a fleet's redirect (before a root route's rewrite).
        asked = route_path(scope) if self._redirect is not None else None
        try:
            scope, session_id = self._to_session(scope)
            fast = self._resolve(scope)
            moved = self._moved(scope, session_id, asked)
            if moved is None and session_id is not None and self._sessions is not None:
                await self._sessions.ensure(session_id, scope["headers"])
        except RolloutSessionError as refusal:
            await self._refuse(scope, receive, send, refusal)
            return
        try:
            body = await self._read_body(scope, receive, keep=moved is None)
        except _ClientGone:
            return  # nobody to answer
        except RolloutSessionError as error:
            await send_response(send, _closing(self._render(scope)(error)))
            return
        if moved is not None:  # read: the connection carries the next request
            await send_response(send, moved)
        elif fast is None:
            await self._app(scope, replay(body, receive), send)
        else:
            await self._serve_fast(*fast, body, receive, send)

    def _to_session(self, scope: HTTPScope) -> tuple[HTTPScope, str | None]:
        """A root model request naming a session, as that session's request
        (its path rewritten), and the session's id; any other unchanged."""
        path = route_path(scope)
        routed = None
        if self._sessions is not None and path is not None:
            routed = self._sessions.route(path, scope["headers"])
        if routed is None:
            return scope, None
        session_path, session_id = routed
        full = scope.get("root_path", "") + session_path
        rewritten: HTTPScope = {**scope, "path": full, "raw_path": full.encode()}
        return rewritten, session_id

    def _moved(self, scope: HTTPScope, routed: str | None, asked: str | None) -> RawResponse | None:
        """A fleet's redirect of a request naming a session another shard
        owns (`routed`: the session a root route named), to the path as
        `asked`; None to serve it here."""
        if self._redirect is None or asked is None:
            return None
        session_id = routed
        path = route_path(scope)
        if session_id is None and path is not None and path.startswith(_SESSIONS):
            found = path[len(_SESSIONS) :].split("/", 1)[0]
            # No session could have another id: this shard answers 404.
            session_id = found if SESSION_ID.fullmatch(found) else None
        if session_id is None:
            return None
        return self._redirect(session_id, asked, scope["query_string"])

    def _render(self, scope: HTTPScope) -> Callable[[Exception], RawResponse]:
        """How an error on this request's path is rendered."""
        path = route_path(scope)
        if path is not None:
            for fast in self._fast:
                if fast.render_error is None:
                    continue
                if fast.error_paths is not None:
                    owns = fast.error_paths(path)
                else:
                    owns = fast.match(path) is not None
                if owns:
                    return fast.render_error
        return error_response

    def _resolve(self, scope: HTTPScope) -> tuple[FastRoute, str] | None:
        """Check the key, then the route: the fast route and its argument, or
        None for Quart's routes. Raises the error to answer with."""
        method = scope["method"]
        path = route_path(scope)
        if self._authorize is not None:
            headers = scope["headers"]
            self._authorize(
                method, path, _header(headers, b"authorization"), _header(headers, b"x-api-key")
            )
        if path is None:
            raise RouteNotFound("no such route")
        for fast in self._fast:
            arg = fast.match(path)
            if arg is not None:
                if method != fast.method:
                    raise MethodNotAllowed(
                        "method not allowed on this route", allowed=[fast.method]
                    )
                return fast, arg
        try:
            self._routes.match(path, method)
        except RequestRedirect:
            pass  # Quart answers it (a slash to add or merge)
        except NotFound:
            raise _not_found(path) from None
        except WerkzeugMethodNotAllowed as exc:
            raise MethodNotAllowed(
                "method not allowed on this route", allowed=exc.valid_methods or []
            ) from None
        return None

    async def _refuse(
        self,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        refusal: RolloutSessionError,
        *,
        close: bool = False,
    ) -> None:
        """Answer `refusal` once the body is drained (or cannot be), closing
        the connection after it if `close`. Drained first even then: h11
        fails a connection whose peer sends bytes past a body it was still
        reading when a closing answer went out, and cuts that answer off."""
        response = self._render(scope)(refusal)
        try:
            await self._read_body(scope, receive, keep=False)  # drain
        except _ClientGone:
            return
        except RolloutSessionError:
            close = True
        await send_response(send, _closing(response) if close else response)

    async def _read_body(
        self, scope: HTTPScope, receive: ASGIReceiveCallable, *, keep: bool
    ) -> bytes:
        """The whole body (b"" unless `keep`). Raises `RequestTooLarge` over
        the limit, `InvalidRequest` past the timeout, `_ClientGone`."""
        declared = _header(scope["headers"], b"content-length")
        if declared.isdigit() and int(declared) > self._limit:
            raise RequestTooLarge()
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(BODY_TIMEOUT_S):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    raise _ClientGone  # http.disconnect
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self._limit:
                    raise RequestTooLarge()
                if keep:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)  # one chunk: itself, not a copy
        raise InvalidRequest(f"the request body did not arrive within {BODY_TIMEOUT_S} s")

    async def _serve_fast(
        self,
        fast: FastRoute,
        arg: str,
        body: bytes,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
    ) -> None:
        async with trio.open_nursery() as nursery:
            # A disconnect cancels the handler, as Quart-Trio does for its own.
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                if self._check_body is not None:
                    self._check_body(body)
                response = await fast.handle(arg, body)
            except Exception as exc:  # every failure gets the error body
                response = (fast.render_error or error_response)(exc)
            await send_response(send, response)
            nursery.cancel_scope.cancel()


# The model routes, for the 404 of a model path that is none of them.
_MODEL_ROUTES = (
    "GET /v1/models, POST /v1/chat/completions, POST /v1/responses, POST /v1/messages, "
    "POST /v1/messages/count_tokens"
)
_SESSION_MODEL = re.compile(r"/sessions/[^/]+/v1/")


def _not_found(path: str) -> RouteNotFound:
    """404 for `path`; for a model path (``/v1/…``, ``/sessions/{id}/v1/…``)
    it says which model routes exist, and how to reach them."""
    if not (path.startswith("/v1/") or _SESSION_MODEL.match(path)):
        return RouteNotFound("no such route")
    hint = (
        f"no such model route: {path}. A session serves {_MODEL_ROUTES}, under "
        "/sessions/{id}/v1 or at /v1 with the session named by its header "
        "(X-Session-ID by default) or by the session's own key"
    )
    if path.startswith("/v1/"):
        hint += "; this request named no session"
    return RouteNotFound(hint)


def ambiguous_framing(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Both Content-Length and Transfer-Encoding (h11 lets Transfer-Encoding
    win, as RFC 9112 allows, and would keep the connection)."""
    length = chunked = False
    for name, _ in headers:
        if name == b"content-length":
            length = True
        elif name == b"transfer-encoding":
            chunked = True
    return length and chunked


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes:
    # ASGI header names are lowercase; the first value counts, as in werkzeug.
    return next((value for key, value in headers if key == name), b"")


def _closing(response: RawResponse) -> RawResponse:
    """`response` for a request whose body was not read: the connection cannot
    carry another request, so the client is told and hypercorn closes it."""
    return response._replace(headers=[*response.headers, _CLOSE])


def replay(body: bytes, receive: ASGIReceiveCallable) -> ASGIReceiveCallable:
    """`receive` for Quart: the body already read, then the connection's own
    messages (the disconnect that cancels a Quart-Trio handler)."""
    pending = True

    async def replayed() -> ASGIReceiveEvent:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _cancel_on_disconnect(receive: ASGIReceiveCallable, scope: trio.CancelScope) -> None:
    # After the body, the only message left is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
