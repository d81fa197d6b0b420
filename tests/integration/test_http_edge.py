"""The HTTP edge over real HTTP, route by route, Quart's and the chat route's.

Every route: the API key (401 without it; ``/health``, ``/ready`` and the
inspector page open), the method (405 with ``Allow``), the body limit (413 with
``Connection: close``), and the connection after each of these: a raw client
writes the request's head, then its body a moment later (as HTTP clients
do), then a second request on the same connection, which must be answered
(or, after ``Connection: close``, the connection closed) without a stall.
Also: unknown paths, and a chat turn under an ASGI ``root_path``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import trio
import trio.testing

from rollout_session import Settings, create_app
from rollout_session.serving import start_server
from rollout_session.tokenization import ChatTokenizer

from ..conftest import Stack, StackFactory
from .raw_http import RawConnection, RawResponse

KEY = "edge-key"
AUTH = {"authorization": f"Bearer {KEY}"}
SID = "s1"
LIMIT_MB = 0.001  # 1,048 bytes
OVER_LIMIT = 4096
BODY = b'{"messages": []}'
# A stall lasts until a timeout (the client's, or keep-alive's 75 s): any
# bound far above a loopback answer detects it.
STALL_S = 10.0


@dataclass(frozen=True)
class Route:
    method: str
    rule: str  # as registered (Quart's URL map), or the chat route's
    public: bool = False  # answered without the key

    @property
    def path(self) -> str:
        return self.rule.replace("<session_id>", SID).replace("<name>", "app.js")

    @property
    def id(self) -> str:
        return f"{self.method} {self.rule}"


CHAT = Route("POST", "/sessions/<session_id>/v1/chat/completions")
ROUTES = [
    Route("GET", "/health", public=True),
    Route("GET", "/ready", public=True),
    Route("POST", "/sessions"),
    Route("GET", "/sessions"),
    Route("GET", "/sessions/<session_id>"),
    Route("DELETE", "/sessions/<session_id>"),
    Route("GET", "/sessions/<session_id>/trajectory"),
    Route("GET", "/sessions/<session_id>/v1/models"),
    CHAT,
    Route("GET", "/sessions/<session_id>/diff"),
    Route("GET", "/workers"),
    Route("POST", "/workers"),
    Route("DELETE", "/workers"),
    Route("POST", "/admin/pause"),
    Route("POST", "/admin/resume"),
    Route("GET", "/metrics"),
    Route("GET", "/ui", public=True),
    Route("GET", "/ui/", public=True),
    Route("GET", "/ui/<name>", public=True),
]


def _allowed(path: str) -> str:
    methods = {r.method for r in ROUTES if r.path == path}
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


@pytest.fixture
async def keyed(make_stack: StackFactory) -> Stack:
    stack = await make_stack(api_key=KEY, max_body_mb=LIMIT_MB)
    await stack.create(session_id=SID)
    return stack


async def head_then_body(
    conn: RawConnection, method: str, path: str, headers: dict[str, str], body: bytes
) -> RawResponse:
    """One request, its body written a moment after the head, as clients do:
    the moment lets the server do all it would do before the body arrives
    (the server runs in this trio loop), answering early included."""
    with trio.fail_after(STALL_S):
        await conn.send_head(method, path, {**headers, "content-length": str(len(body))})
        await trio.testing.wait_all_tasks_blocked()
        await conn.send(body)
        return await conn.response()


async def assert_next_request_answered(conn: RawConnection, after: str) -> None:
    try:
        with trio.fail_after(STALL_S):
            response = await conn.request("GET", "/health")
    except trio.TooSlowError:
        raise AssertionError(f"the request after {after} stalled") from None
    assert response.status == 200, (after, response.body)


async def assert_over_limit_closes(conn: RawConnection, route: Route, framing: str) -> None:
    with trio.fail_after(STALL_S):
        if framing == "content-length":
            # Answered from the header: the body is never sent.
            headers = {**AUTH, "content-length": str(OVER_LIMIT)}
            await conn.send_head(route.method, route.path, headers)
        else:
            await conn.send_head(route.method, route.path, {**AUTH, "transfer-encoding": "chunked"})
            await conn.send(b"%x\r\n%s\r\n" % (OVER_LIMIT, b" " * OVER_LIMIT))
        response = await conn.response()
        assert response.status == 413, (framing, response.body)
        assert b'"code":"request_too_large"' in response.body
        # The body is left unread, so the connection cannot carry another
        # request: the client is told, and the server closes it at once.
        assert response.closes, framing
        assert await conn.closed_by_server(), framing


def test_the_walk_covers_every_route() -> None:
    app = create_app(Settings(workers=("http://127.0.0.1:9",)))
    registered = {
        (method, rule.rule)
        for rule in app.url_map.iter_rules()
        for method in rule.methods or ()
        if method not in ("HEAD", "OPTIONS")
    }
    assert {(r.method, r.rule) for r in ROUTES} == registered | {(CHAT.method, CHAT.rule)}


@pytest.mark.parametrize("route", ROUTES, ids=[r.id for r in ROUTES])
async def test_every_route_at_the_edge(keyed: Stack, route: Route) -> None:
    conn = await RawConnection.open(keyed.url)
    try:
        # The key, or a public route answered without it.
        response = await head_then_body(conn, route.method, route.path, {}, BODY)
        if route.public:
            assert response.status == 200, response.body
        else:
            assert response.status == 401, response.body
            assert b'"code":"unauthorized"' in response.body
        assert not response.closes
        await assert_next_request_answered(conn, f"{response.status} without the key")

        response = await head_then_body(conn, "PATCH", route.path, AUTH, BODY)
        assert response.status == 405, response.body
        assert b'"code":"method_not_allowed"' in response.body
        assert response.headers["allow"] == _allowed(route.path)
        assert not response.closes
        await assert_next_request_answered(conn, "405")

        # The handler's own answer (whatever it is for this body) must not
        # leave the body on the connection either.
        response = await head_then_body(conn, route.method, route.path, AUTH, b"{}")
        assert response.status < 500, response.body
        assert not response.closes
        await assert_next_request_answered(conn, f"the handler's {response.status}")
    finally:
        await conn.aclose()
    for framing in ("content-length", "chunked"):
        conn = await RawConnection.open(keyed.url)
        try:
            await assert_over_limit_closes(conn, route, framing)
        finally:
            await conn.aclose()
    assert keyed.emulator.received == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/responses"),
        ("POST", f"/sessions/{SID}/v1/responses"),
        ("POST", f"/sessions/{SID}/v1/chat/completions/"),
        ("POST", f"/sessions/{SID}/x/v1/chat/completions"),
        ("GET", "/ui/missing.js"),
    ],
    ids=["responses-api", "session-responses-api", "chat-slash", "chat-two-segments", "ui-asset"],
)
async def test_unknown_paths_are_404_and_the_connection_kept(
    keyed: Stack, method: str, path: str
) -> None:
    conn = await RawConnection.open(keyed.url)
    try:
        # The key is checked first: without it, an unknown path is not told apart.
        for headers, status in (({}, 401), (AUTH, 404)):
            response = await head_then_body(conn, method, path, headers, BODY)
            assert response.status == status, response.body
            assert not response.closes
            await assert_next_request_answered(conn, str(status))
    finally:
        await conn.aclose()


ROOT = "/rollout"


@pytest.fixture
async def rooted_url(
    nursery: trio.Nursery, stack: Stack, chat_tokenizers: dict[str, ChatTokenizer]
) -> AsyncIterator[str]:
    """A second server on the stack's worker, mounted at `ROOT` (hypercorn's
    ``root_path``: the scope's path keeps it, as the ASGI spec has it)."""
    app = create_app(
        Settings(workers=(stack.emulator_url,), port=0), tokenizer=chat_tokenizers["chatml"]
    )
    server = await start_server(nursery, app, root_path=ROOT)
    yield server.url
    await server.aclose()


async def test_a_chat_turn_under_a_root_path(rooted_url: str) -> None:
    async with httpx.AsyncClient(base_url=rooted_url + ROOT, timeout=STALL_S) as client:
        created = await client.post("/sessions", json={})
        assert created.status_code == 201, created.text
        chat_url = created.json()["base_url"] + "/chat/completions"
        messages = [{"role": "user", "content": "hi"}]
        turn = await client.post(chat_url, json={"messages": messages})
        assert turn.status_code == 200, turn.text
        assert turn.json()["choices"][0]["message"]["content"]
        session = (await client.get(created.json()["base_url"].removesuffix("/v1"))).json()
        assert session["num_turns"] == 1
    async with httpx.AsyncClient(base_url=rooted_url, timeout=STALL_S) as outside:
        # Outside the root path nothing matches, the chat route included.
        missed = await outside.post(chat_url, json={"messages": messages})
        assert missed.status_code == 404
        assert missed.json()["error"]["code"] == "not_found"
