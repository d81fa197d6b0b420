"""The HTTP surface: session routes, health, models, and the bad-input table."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import Stack, StackFactory
from tests.loopback import TLS

USER = [{"role": "user", "content": "hi"}]


async def test_health_never_touches_a_worker(stack: Stack) -> None:
    first = (await stack.client.get("/health")).json()
    await stack.create()
    second = (await stack.client.get("/health")).json()
    assert first["status"] == "ok" and len(first["instance_id"]) == 32
    assert first["instance_id"] == second["instance_id"]
    assert first["workers"] == {"healthy": 1, "total": 1}
    assert (first["sessions"], second["sessions"]) == (0, 1)
    assert stack.emulator.received == 0


async def test_create_get_list_and_page_sessions(stack: Stack) -> None:
    created = await stack.client.post(
        "/sessions", json={"session_id": "ep:1", "metadata": {"k": 1}}
    )
    assert created.status_code == 201
    assert created.json()["base_url"] == "/sessions/ep:1/v1"
    generated = (await stack.client.post("/sessions")).json()["session_id"]
    assert len(generated) == 32 and int(generated, 16) >= 0
    await stack.chat("ep:1", messages=USER)
    summary = (await stack.client.get("/sessions/ep:1")).json()
    assert summary["state"] == "open" and summary["num_turns"] == 1
    assert summary["num_tokens"] > 0 and summary["worker"] == stack.emulator_url
    assert summary["metadata"] == {"k": 1}
    page1 = (await stack.client.get("/sessions", params={"limit": 1})).json()
    assert [s["session_id"] for s in page1["sessions"]] == ["ep:1"] and page1["has_more"]
    page2 = (await stack.client.get("/sessions", params={"limit": 1, "after": "ep:1"})).json()
    assert [s["session_id"] for s in page2["sessions"]] == [generated]
    assert not page2["has_more"]
    expired = (await stack.client.get("/sessions", params={"state": "expired"})).json()
    assert expired["sessions"] == []


async def test_create_is_idempotent_by_id(stack: Stack) -> None:
    assert (await stack.client.post("/sessions", json={"session_id": "a"})).status_code == 201
    again = await stack.client.post("/sessions", json={"session_id": "a"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "session_exists"


async def test_models_lists_the_served_model(stack: Stack) -> None:
    session_id = await stack.create()
    models = (await stack.client.get(f"/sessions/{session_id}/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == stack.emulator.config.model_name


BAD_CHAT: list[tuple[str, Any, int, str]] = [
    ("not-json", b"{", 400, "invalid_request"),
    ("not-object", b"[1]", 400, "invalid_request"),
    ("no-messages", {}, 400, "invalid_request"),
    ("messages-not-list", {"messages": "hi"}, 400, "invalid_request"),
    ("empty-messages", {"messages": []}, 400, "invalid_request"),
    ("unknown-role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request"),
    ("content-int", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request"),
    (
        "image-part",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "invalid_request",
    ),
    ("n-2", {"messages": USER, "n": 2}, 400, "invalid_request"),
    ("temperature-str", {"messages": USER, "temperature": "hot"}, 400, "invalid_request"),
    (
        "temperature-nan",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        "invalid_request",
    ),
    ("temperature-high", {"messages": USER, "temperature": 9.5}, 400, "invalid_request"),
    ("max-tokens-0", {"messages": USER, "max_tokens": 0}, 400, "invalid_request"),
    ("max-tokens-bool", {"messages": USER, "max_tokens": True}, 400, "invalid_request"),
    ("stop-int", {"messages": USER, "stop": 3}, 400, "invalid_request"),
    ("tools-not-list", {"messages": USER, "tools": {"a": 1}}, 400, "invalid_request"),
    ("tool-no-name", {"messages": USER, "tools": [{"type": "function"}]}, 400, "invalid_request"),
    ("stream-str", {"messages": USER, "stream": "yes"}, 400, "invalid_request"),
    (
        "tool-call-args-int",
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}
            ]
        },
        400,
        "invalid_request",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "code"), [c[1:] for c in BAD_CHAT], ids=[c[0] for c in BAD_CHAT]
)
async def test_bad_chat_request(stack: Stack, body: Any, status: int, code: str) -> None:
    session_id = await stack.create()
    url = f"/sessions/{session_id}/v1/chat/completions"
    if isinstance(body, bytes):
        response = await stack.client.post(url, content=body)
    else:
        response = await stack.client.post(url, json=body)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    assert response.json()["error"]["message"]
    assert stack.emulator.received == 0
    assert stack.ctx.registry.get(session_id).slot is None


async def test_assistant_appended_by_agent_starts_a_segment_or_is_rejected(
    make_stack: StackFactory,
) -> None:
    """An agent that writes an assistant message itself: the template does
    not render it as a turn to extend. By default a new segment; strictly,
    400 naming the message."""
    for policy in ("segment", "error"):
        stack = await make_stack(on_divergence=policy)
        session_id = await stack.create()
        first = (await stack.chat(session_id, messages=USER)).json()["choices"][0]["message"]
        messages = [
            *USER,
            {"role": "assistant", "content": first["content"]},
            {"role": "assistant", "content": "I made this up"},
        ]
        response = await stack.chat(session_id, messages=messages)
        doc = await stack.trajectory(session_id, schema=3)
        if policy == "segment":
            assert response.status_code == 200, response.text
            assert doc["segments"][1]["branch"] == {
                "reason": "appended_role",
                "segment": 0,
                "message": 2,
            }
            continue
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_request"
        assert response.json()["error"]["param"] == "messages[2].role"
        assert stack.emulator.received == 1 and doc["num_segments"] == 1


BAD_CREATE = [
    ("bad-id-chars", {"session_id": "has space"}, 400, "invalid_request"),
    ("bad-id-long", {"session_id": "x" * 129}, 400, "invalid_request"),
    ("bad-id-type", {"session_id": 7}, 400, "invalid_request"),
    ("metadata-list", {"metadata": [1]}, 400, "invalid_request"),
    ("ttl-negative", {"ttl_s": -1}, 400, "invalid_request"),
    ("ttl-bool", {"ttl_s": True}, 400, "invalid_request"),
]


@pytest.mark.parametrize(
    ("body", "status", "code"), [c[1:] for c in BAD_CREATE], ids=[c[0] for c in BAD_CREATE]
)
async def test_bad_create(stack: Stack, body: Any, status: int, code: str) -> None:
    response = await stack.client.post("/sessions", json=body)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/sessions/nope"),
        ("GET", "/sessions/nope/trajectory"),
        ("DELETE", "/sessions/nope"),
        ("POST", "/sessions/nope/v1/chat/completions"),
        ("GET", "/sessions/nope/v1/models"),
    ],
    ids=["get", "trajectory", "delete", "chat", "models"],
)
async def test_unknown_session_is_404(stack: Stack, method: str, path: str) -> None:
    response = await stack.client.request(method, path, json={"messages": USER})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "session_not_found"


async def test_oversized_body_is_413_and_closes_connection(make_stack: StackFactory) -> None:
    stack = await make_stack(max_body_mb=0.01)
    session_id = await stack.create()
    big = {"messages": [{"role": "user", "content": "x" * 20_000}]}
    response = await stack.chat(session_id, **big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert response.headers["connection"] == "close"
    # The next request on a fresh connection is served normally.
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    async with httpx.AsyncClient(base_url=stack.url, verify=TLS) as fresh:
        assert (await fresh.get("/health")).status_code == 200
