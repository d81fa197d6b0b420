"""Hostile framing and ids at the edge, over real HTTP.

- A request with both Content-Length and Transfer-Encoding is refused and its
  connection closed with nothing after its chunked body read: behind a proxy
  that framed it by its length, the chunked reading would turn the rest of
  the body into a second, smuggled request on the server's side. The answer
  arrives whole although those bytes follow the body.
- Session ids match their pattern in full and are usable as a URL segment.
- The default body limit is a model server's, not 64 MB.
"""

from __future__ import annotations

import pytest
import trio

from rollout_session import Settings
from tests.conftest import Stack, StackFactory
from tests.integration.raw_http import RawConnection

STALL_S = 10.0
KEY = "k"
AUTH_LINE = f"authorization: Bearer {KEY}"


def smuggling(path: str, sid: str) -> bytes:
    """A request framed both ways: by its Content-Length, its body is the
    chunked body plus a DELETE of session `sid`; by Transfer-Encoding, the
    DELETE is a second request."""
    smuggled = f"DELETE /sessions/{sid} HTTP/1.1\r\nhost: x\r\n{AUTH_LINE}\r\n\r\n"
    body = "0\r\n\r\n" + smuggled
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\n{AUTH_LINE}\r\n"
        f"content-length: {len(body)}\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    return (head + body).encode()


@pytest.mark.parametrize(
    "path",
    ["/sessions", "/sessions/victim/v1/chat/completions", "/nowhere"],
    ids=["quart-route", "chat-route", "unknown-path"],
)
async def test_content_length_with_transfer_encoding_is_refused_and_closed(
    make_stack: StackFactory, path: str
) -> None:
    stack = await make_stack(api_key=KEY)
    await stack.create(session_id="victim")
    conn = await RawConnection.open(stack.url)
    try:
        with trio.fail_after(STALL_S):
            await conn.send(smuggling(path, "victim"))
            response = await conn.response()
            assert response.status == 400, response.body
            assert b'"code":"invalid_request"' in response.body
            assert b"Transfer-Encoding" in response.body
            assert response.closes
            assert await conn.closed_by_server()
    finally:
        await conn.aclose()
    # Neither request ran: no session created, the victim still there.
    assert [s.id for s in stack.ctx.registry] == ["victim"]
    assert stack.emulator.received == 0


@pytest.mark.parametrize(
    "session_id",
    ["abc\n", ".", "..", "a/b", "a b", "", "x" * 129],
    ids=["final-newline", "dot", "dot-dot", "slash", "space", "empty", "too-long"],
)
async def test_bad_session_ids_are_refused(stack: Stack, session_id: str) -> None:
    response = await stack.client.post("/sessions", json={"session_id": session_id})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "session_id")
    assert len(stack.ctx.registry) == 0


@pytest.mark.parametrize(
    "session_id", ["a.b", "...", ".x", "run:7-a_b"], ids=["dotted", "three-dots", "lead-dot", "all"]
)
async def test_ids_that_are_url_segments_are_accepted(stack: Stack, session_id: str) -> None:
    await stack.create(session_id=session_id)
    response = await stack.chat(session_id, messages=[{"role": "user", "content": "hi"}])
    assert response.status_code == 200, response.text


async def test_the_default_body_limit_is_16_mib(stack: Stack) -> None:
    assert Settings(demo=True).max_body_bytes == 16 * 1024 * 1024
    conn = await RawConnection.open(stack.url)
    try:
        with trio.fail_after(STALL_S):
            # Judged from the header: the body is never sent.
            length = str(16 * 1024 * 1024 + 1)
            await conn.send_head("POST", "/sessions", {"content-length": length})
            response = await conn.response()
        assert response.status == 413, response.body
        assert response.closes
    finally:
        await conn.aclose()
