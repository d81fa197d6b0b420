"""The chat route, ``POST /sessions/{id}/v1/chat/completions``: every agent turn.

Served by the HTTP edge itself (`edge.FastRoute`), not through Quart:
Quart's per-request machinery (request and app contexts, URL matching, a
task per request, werkzeug headers) is CPU every turn would pay
(docs/performance.md#chat-route-below-quart). The edge has already
checked the key and read the body when `ChatRoute.handle` runs, and renders
what it raises; this module turns a turn's outcome into the response.
"""

from __future__ import annotations

from ...engines.base import AgentReply
from ..context import ServerContext
from ..edge import FastRoute, RawResponse, session_route
from .sse import sse_answer, sse_body

__all__ = ["chat_route", "chat_session_id", "passthrough"]

_JSON = b"application/json"

# The session id if a path is the chat route, else None.
chat_session_id = session_route("/v1/chat/completions")


def chat_route(ctx: ServerContext) -> FastRoute:
    """The chat route for the edge, bound to `ctx`."""

    async def handle(session_id: str, body: bytes) -> RawResponse:
        # The turn is committed and its slot released when `run` returns:
        # an agent that goes away while the answer is sent loses nothing.
        outcome = await ctx.turn_runner.run(session_id, body)
        reply = outcome.reply
        # Errors (ours, raised above, or the worker's non-200) stay JSON with
        # their status, streaming or not, so SDKs raise the typed exception.
        if reply.status == 200 and outcome.stream is not None:
            events = await ctx.offload.run(len(reply.body), sse_body, reply.body, outcome.stream)
            return sse_answer(events)
        return passthrough(reply)

    return FastRoute(method="POST", match=chat_session_id, handle=handle)


def passthrough(reply: AgentReply) -> RawResponse:
    """The worker's answer as it came (its status, headers and body)."""
    content_type = next((v for k, v in reply.headers if k == b"content-type"), _JSON)
    headers = [(k, v) for k, v in reply.headers if k != b"content-type"]
    headers.append((b"content-type", content_type))
    return RawResponse(reply.status, headers, reply.body)
