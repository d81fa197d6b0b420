"""Bytes between a route handler and Quart, for both engines' routes: a JSON
answer, a handler's `faults.Reply`, and the request's raw body."""

from __future__ import annotations

from typing import Any

import orjson
from quart import Response, request

from rollout_session.emulator.faults import Reply

__all__ = ["json_response", "raw_body", "reply_response"]


def json_response(payload: Any) -> Response:
    return Response(orjson.dumps(payload), content_type="application/json")


def reply_response(reply: Reply) -> Response:
    return Response(
        reply.body, status=reply.status, content_type=reply.content_type, headers=reply.headers
    )


async def raw_body() -> bytes:
    """The body as sent (never parsed by Quart: the handler parses it as its engine does)."""
    data: bytes = await request.get_data(cache=False, as_text=False, parse_form_data=False)
    return data
