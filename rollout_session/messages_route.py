"""The Messages routes, ``POST /sessions/{id}/v1/messages`` and
``…/v1/messages/count_tokens``: a turn asked in the Anthropic Messages API
(conversion: `anthropic_messages`).

Served by the HTTP edge, like the chat route (chat_route.py): the edge has
checked the key and read the body. Every error on these routes, the edge's
own included (401, 413, …), is rendered in Anthropic's error shape
(`render_error`), so the ``anthropic`` SDK raises its typed exception.
"""

from __future__ import annotations

import orjson

from .anthropic_messages import (
    error_body,
    error_of,
    message_events,
    parse_messages_request,
    render_message,
    worker_error_message,
)
from .context import ServerContext
from .http_edge import FastRoute, Headers, RawResponse, as_error
from .protocol import parse_chat_request
from .streaming import SSE_CONTENT_TYPE, SSE_HEADERS
from .turn_plan import plan_turn

__all__ = ["is_messages_path", "messages_routes", "render_error"]

_PREFIX = "/sessions/"
_MESSAGES = "/v1/messages"
_COUNT = "/v1/messages/count_tokens"
_JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
_SSE_HEADERS: Headers = [
    (b"content-type", SSE_CONTENT_TYPE.encode()),
    *((k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()),
]


def _session_id(path: str, suffix: str) -> str | None:
    if not (path.startswith(_PREFIX) and path.endswith(suffix)):
        return None
    session_id = path[len(_PREFIX) : len(path) - len(suffix)]
    return session_id if session_id and "/" not in session_id else None


def messages_session_id(path: str) -> str | None:
    """The session id if `path` is the Messages route, else None."""
    return _session_id(path, _MESSAGES)


def count_session_id(path: str) -> str | None:
    """The session id if `path` is the count_tokens route, else None."""
    return _session_id(path, _COUNT)


def is_messages_path(path: str) -> bool:
    """A Messages path, at the root (no session named) or a session's."""
    return path in (_MESSAGES, _COUNT) or any(
        _session_id(path, suffix) is not None for suffix in (_MESSAGES, _COUNT)
    )


def render_error(exc: Exception) -> RawResponse:
    """`exc` in Anthropic's error shape, with its status and headers."""
    error = as_error(exc)
    headers = [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    headers.append((b"content-type", b"application/json"))
    return RawResponse(error.status_code, headers, error_of(error))


def messages_routes(ctx: ServerContext) -> list[FastRoute]:
    """The Messages and count_tokens routes for the edge, bound to `ctx`."""

    async def messages(session_id: str, body: bytes) -> RawResponse:
        request = await ctx.offload.run(len(body), parse_messages_request, body)
        outcome = await ctx.turn_runner.run(session_id, orjson.dumps(request.chat))
        reply = outcome.reply
        if reply.status != 200:
            # The worker's own error (nothing committed), in Anthropic's shape.
            text = worker_error_message(reply.body)
            return RawResponse(reply.status, list(_JSON_HEADERS), error_body(reply.status, text))
        message = render_message(orjson.loads(reply.body), request)
        if request.stream:
            return RawResponse(200, list(_SSE_HEADERS), message_events(message))
        return RawResponse(200, list(_JSON_HEADERS), orjson.dumps(message))

    async def count_tokens(session_id: str, body: bytes) -> RawResponse:
        request = parse_messages_request(body, count_only=True)
        chat = parse_chat_request(orjson.dumps(request.chat))
        runner = ctx.turn_runner
        # Pure: the prompt the turn would send, nothing committed. On the
        # loop, not a thread: the session may not change while it is read
        # (a turn's commit runs on the loop too).
        plan = plan_turn(ctx.registry.get(session_id), chat, runner.tokenizer, runner.policy)
        return RawResponse(
            200, list(_JSON_HEADERS), orjson.dumps({"input_tokens": len(plan.input_ids)})
        )

    return [
        FastRoute(
            method="POST",
            match=messages_session_id,
            handle=messages,
            render_error=render_error,
            error_paths=is_messages_path,
        ),
        FastRoute(
            method="POST",
            match=count_session_id,
            handle=count_tokens,
            render_error=render_error,
            error_paths=is_messages_path,
        ),
    ]
