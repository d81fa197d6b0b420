"""The Messages routes, ``POST /sessions/{id}/v1/messages`` and
``…/v1/messages/count_tokens``: a turn asked in the Anthropic Messages API
(conversion: `messages_codec`).

Served by the HTTP edge, like the chat route (`chat.py`): the edge has
checked the key and read the body. Every error on these routes, the edge's
own included (401, 413, …), is rendered in Anthropic's error shape
(`render_error`), so the ``anthropic`` SDK raises its typed exception.
"""

from __future__ import annotations

import orjson

from ...turn.request import chat_request
from ..context import ServerContext
from ..edge import FastRoute, RawResponse, error_response, json_answer, session_route
from .messages_codec import (
    error_body,
    error_of,
    message_events,
    parse_messages_request,
    render_message,
    worker_error_message,
)
from .sse import sse_answer

__all__ = ["is_messages_path", "messages_routes", "render_error"]

_MESSAGES = "/v1/messages"
_COUNT = "/v1/messages/count_tokens"
# The session id if a path is the Messages (count_tokens) route, else None.
messages_session_id = session_route(_MESSAGES)
count_session_id = session_route(_COUNT)


def is_messages_path(path: str) -> bool:
    """A Messages path, at the root (no session named) or a session's."""
    return (
        path in (_MESSAGES, _COUNT)
        or messages_session_id(path) is not None
        or count_session_id(path) is not None
    )


def render_error(exc: Exception) -> RawResponse:
    """`exc` in Anthropic's error shape, with its status and headers."""
    return error_response(exc, error_of)


def messages_routes(ctx: ServerContext) -> list[FastRoute]:
    """The Messages and count_tokens routes for the edge, bound to `ctx`."""

    async def messages(session_id: str, body: bytes) -> RawResponse:
        request = await ctx.offload.run(len(body), parse_messages_request, body)
        outcome = await ctx.turn_runner.run(
            session_id, body, lambda _session: chat_request(request.chat)
        )
        reply = outcome.reply
        if reply.status != 200:
            # The worker's own error (nothing committed), in Anthropic's shape.
            text = worker_error_message(reply.body)
            return json_answer(reply.status, error_body(reply.status, text))
        message = render_message(orjson.loads(reply.body), request)
        if request.stream:
            return sse_answer(message_events(message))
        return json_answer(200, orjson.dumps(message))

    async def count_tokens(session_id: str, body: bytes) -> RawResponse:
        request = parse_messages_request(body, count_only=True)
        count = ctx.turn_runner.count_tokens(session_id, lambda _s: chat_request(request.chat))
        return json_answer(200, orjson.dumps({"input_tokens": count}))

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
