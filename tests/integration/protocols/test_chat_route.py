"""The chat route, served by the HTTP edge below Quart: what Quart did for it still holds."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from rollout_session.http.protocols.chat import chat_session_id
from tests.conftest import Stack, StackFactory

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/sessions/abc/v1/chat/completions", "abc"),
        ("/sessions/a.b-c_d/v1/chat/completions", "a.b-c_d"),
        ("/sessions//v1/chat/completions", None),
        ("/sessions/v1/chat/completions", None),
        ("/sessions/a/b/v1/chat/completions", None),
        ("/sessions/abc/v1/chat/completions/", None),
        ("/sessions/abc/v1/models", None),
        ("/x/sessions/abc/v1/chat/completions", None),
    ],
    ids=["plain", "punctuation", "empty", "no-segment", "two-segments", "slash", "other", "prefix"],
)
def test_chat_session_id(path: str, expected: str | None) -> None:
    assert chat_session_id(path) == expected


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_other_methods_are_405_with_error_body(stack: Stack, method: str) -> None:
    session_id = await stack.create()
    response = await stack.client.request(method, f"/sessions/{session_id}/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert stack.emulator.received == 0


async def test_near_misses_are_other_routes(stack: Stack) -> None:
    session_id = await stack.create()
    response = await stack.client.post(f"/sessions/{session_id}/v1/chat/completions/", json={})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    # The routes next to it are still Quart's.
    assert (await stack.client.get(f"/sessions/{session_id}/v1/models")).status_code == 200


async def test_chunked_body_over_the_limit_is_413(make_stack: StackFactory) -> None:
    stack = await make_stack(max_body_mb=0.01)
    session_id = await stack.create()

    async def chunks() -> Any:
        # No content-length: the limit must hold while the body streams in.
        for _ in range(4):
            yield b" " * 4096

    response = await stack.client.post(
        f"/sessions/{session_id}/v1/chat/completions", content=chunks()
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert stack.emulator.received == 0


async def test_unexpected_error_is_500_logged_and_releases(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr("rollout_session.engines.sglang_chat.engine.chat_body", broken)
    session_id = await stack.create()
    with caplog.at_level(logging.ERROR, logger="rollout_session"):
        response = await stack.chat(session_id, messages=USER)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "internal_error" and "boom" not in error["message"]
    assert any(r.exc_info and "boom" in str(r.exc_info[1]) for r in caplog.records)
    session = stack.ctx.registry.get(session_id)
    assert session.slot is None and session.trajectory.turns == []
    assert (await stack.chat(session_id, messages=USER)).status_code == 500
