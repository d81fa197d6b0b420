"""The Responses route, ``POST /sessions/{id}/v1/responses``: a turn asked in
the OpenAI Responses API (conversion: `responses_codec`).

Served by the HTTP edge, like the chat route (`chat.py`): the edge has
checked the key and read the body, and renders what this raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from ...prompt.messages import Message
from ...session.session import Session
from ...turn.request import ChatRequest
from ..context import ServerContext
from ..edge import FastRoute, RawResponse, json_answer, session_route
from .chat import passthrough
from .responses_codec import (
    chat_of,
    parse_responses_request,
    render_response,
    response_events,
    response_id,
    turn_of_response,
)
from .sse import sse_answer

__all__ = ["responses_route", "responses_session_id"]

# The session id if a path is the Responses route, else None.
responses_session_id = session_route("/v1/responses")


def responses_route(ctx: ServerContext) -> FastRoute:
    """The Responses route for the edge, bound to `ctx`."""

    async def handle(session_id: str, body: bytes) -> RawResponse:
        request = await ctx.offload.run(len(body), parse_responses_request, body)
        previous = request.previous_response_id

        def decode(session: Session) -> ChatRequest:
            # Inside the turn's slot: the session holds the conversation, and
            # the previous response's part of it comes first (O(history),
            # once per request).
            history: Sequence[Message] = ()
            if previous is not None:
                turns = session.trajectory.turns
                turn = turn_of_response(previous, len(session.earlier), turns)
                history = session.conversation.messages()[: turn.messages_end]
            return chat_of(request, history)

        outcome = await ctx.turn_runner.run(session_id, body, decode)
        if outcome.reply.status != 200 or outcome.turn is None:
            return passthrough(outcome.reply)  # the worker's own error, as on the chat route
        answer = orjson.loads(outcome.reply.body)
        rid = response_id(outcome.segment, outcome.turn)
        response = render_response(answer, request, rid, previous=previous)
        if request.stream:
            return sse_answer(response_events(response))
        return json_answer(200, orjson.dumps(response))

    return FastRoute(method="POST", match=responses_session_id, handle=handle)
