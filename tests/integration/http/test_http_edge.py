"""The HTTP edge over real HTTP, route by route, Quart's and the chat route's.

Every route: the keys (401 without one; ``/health``, ``/ready`` and the
inspector page open; each role's key reaching its routes and no others, 403
for the trainer's key on an operator route), the method (405 with ``Allow``),
the body limit (413 with ``Connection: close``), and the connection after
each of these: a raw client
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
from rollout_session.http.auth import Access
from rollout_session.http.serving import start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import Stack, StackFactory
from tests.integration.raw_http import RawConnection, RawResponse
from tests.loopback import TLS

KEY = "edge-key"
ADMIN = "edge-admin-key"
AUTH = {"authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
SID = "s1"
OTHER_SID = "s2"
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
    access: Access = Access.TRAINER  # which keys reach it (auth.Access)
    # A root model route: a session's key reaches its own session's route
    # through it (session_routing.py), so every key does.
    any_key: bool = False

    @property
    def path(self) -> str:
        return self.rule.replace("<session_id>", SID).replace("<name>", "app.js")

    @property
    def id(self) -> str:
        return f"{self.method} {self.rule}"

    @property
    def other_method_access(self) -> Access:
        """The inspector's files are public for GET and HEAD only; /health and
        /ready for every method (app.is_public)."""
        public_any_method = self.rule in ("/health", "/ready")
        if self.access is Access.PUBLIC and not public_any_method:
            return Access.TRAINER
        return self.access

    @property
    def auth(self) -> dict[str, str]:
        """The headers of the key meant for this route."""
        return ADMIN_AUTH if self.access is Access.OPERATOR else AUTH


CHAT = Route("POST", "/sessions/<session_id>/v1/chat/completions", Access.MODEL)
RESPONSES = Route("POST", "/sessions/<session_id>/v1/responses", Access.MODEL)
MESSAGES = Route("POST", "/sessions/<session_id>/v1/messages", Access.MODEL)
COUNT_TOKENS = Route("POST", "/sessions/<session_id>/v1/messages/count_tokens", Access.MODEL)
# Served by the edge itself, not in Quart's URL map.
FAST = [CHAT, RESPONSES, MESSAGES, COUNT_TOKENS]
ROUTES = [
    Route("GET", "/health", Access.PUBLIC),
    Route("GET", "/ready", Access.PUBLIC),
    Route("POST", "/sessions"),
    Route("GET", "/sessions"),
    Route("GET", "/sessions/<session_id>"),
    Route("DELETE", "/sessions/<session_id>"),
    Route("GET", "/sessions/<session_id>/trajectory"),
    Route("POST", "/sessions/<session_id>/rescore"),
    Route("GET", "/sessions/<session_id>/v1/models", Access.MODEL),
    Route("GET", "/v1/models", any_key=True),
    CHAT,
    RESPONSES,
    MESSAGES,
    COUNT_TOKENS,
    Route("GET", "/sessions/<session_id>/diff"),
    Route("GET", "/workers", Access.OPERATOR),
    Route("POST", "/workers", Access.OPERATOR),
    Route("DELETE", "/workers", Access.OPERATOR),
    Route("POST", "/admin/pause", Access.OPERATOR),
    Route("POST", "/admin/resume", Access.OPERATOR),
    Route("GET", "/metrics", Access.OPERATOR),
    Route("GET", "/ui", Access.PUBLIC),
    Route("GET", "/ui/", Access.PUBLIC),
    Route("GET", "/ui/<name>", Access.PUBLIC),
]
# Who holds which key: nobody, another session's agent, this session's agent,
# the trainer, the operator.
HOLDERS = ["none", "other-session", "own-session", "trainer", "operator"]
# (holder, access) → the status of a request the key reaches (0) or refuses.
REFUSED = {
    ("none", Access.MODEL): 401,
    ("none", Access.TRAINER): 401,
    ("none", Access.OPERATOR): 401,
    ("other-session", Access.MODEL): 401,
    ("other-session", Access.TRAINER): 401,
    ("other-session", Access.OPERATOR): 401,
    ("own-session", Access.TRAINER): 401,
    ("own-session", Access.OPERATOR): 401,
    ("trainer", Access.OPERATOR): 403,
}


def _allowed(path: str) -> str:
    methods = {r.method for r in ROUTES if r.path == path}
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


@dataclass
class Keyed:
    stack: Stack
    headers: dict[str, dict[str, str]]  # by holder

    @property
    def url(self) -> str:
        return self.stack.url


@pytest.fixture
async def keyed(make_stack: StackFactory) -> Keyed:
    stack = await make_stack(api_key=KEY, admin_api_key=ADMIN, max_body_mb=LIMIT_MB)
    keys = {}
    for sid in (SID, OTHER_SID):
        created = await stack.client.post("/sessions", json={"session_id": sid})
        keys[sid] = created.json()["api_key"]
    headers = {
        "none": {},
        "other-session": {"authorization": f"Bearer {keys[OTHER_SID]}"},
        "own-session": {"authorization": f"Bearer {keys[SID]}"},
        "trainer": AUTH,
        "operator": ADMIN_AUTH,
    }
    return Keyed(stack, headers)


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
            headers = {**route.auth, "content-length": str(OVER_LIMIT)}
            await conn.send_head(route.method, route.path, headers)
        else:
            chunked = {**route.auth, "transfer-encoding": "chunked"}
            await conn.send_head(route.method, route.path, chunked)
            await conn.send(b"%x\r\n%s\r\n" % (OVER_LIMIT, b" " * OVER_LIMIT))
        response = await conn.response()
        assert response.status == 413, (framing, response.body)
        assert b'"code":"request_too_large"' in response.body
        # The body is left unread, so the connection cannot carry another
        # request: the client is told, and the server closes it at once.
        assert response.closes, framing
        assert await conn.closed_by_server(), framing


def test_the_walk_covers_every_route() -> None:
    app = create_app(Settings(workers=("http://127.0.0.1:9",)), worker_tls=TLS)
    registered = {
        (method, rule.rule)
        for rule in app.url_map.iter_rules()
        for method in rule.methods or ()
        if method not in ("HEAD", "OPTIONS")
    }
    assert {(r.method, r.rule) for r in ROUTES} == registered | {(r.method, r.rule) for r in FAST}


@pytest.mark.parametrize("route", ROUTES, ids=[r.id for r in ROUTES])
async def test_every_route_at_the_edge(keyed: Keyed, route: Route) -> None:
    conn = await RawConnection.open(keyed.url)
    try:
        # No key: 401, or a public route answered without it.
        response = await head_then_body(conn, route.method, route.path, {}, BODY)
        if route.access is Access.PUBLIC:
            assert response.status == 200, response.body
        else:
            assert response.status == 401, response.body
            assert b'"code":"unauthorized"' in response.body
        assert not response.closes
        await assert_next_request_answered(conn, f"{response.status} without the key")

        # Each holder's key, probed with another method: a key that reaches
        # the route gets 405 (the key is checked first, and nothing runs).
        for holder in HOLDERS:
            headers = keyed.headers[holder]
            response = await head_then_body(conn, "PATCH", route.path, headers, BODY)
            refused = REFUSED.get((holder, route.other_method_access), 0)
            if route.any_key:
                refused = 401 if holder == "none" else 0
            if refused:
                assert response.status == refused, (holder, response.body)
                code = b"unauthorized" if refused == 401 else b"permission_denied"
                assert b'"code":"' + code + b'"' in response.body
            else:
                assert response.status == 405, (holder, response.body)
                assert b'"code":"method_not_allowed"' in response.body
                assert response.headers["allow"] == _allowed(route.path)
            assert not response.closes
            await assert_next_request_answered(conn, f"{response.status} for {holder}")

        # The handler's own answer (whatever it is for this body) must not
        # leave the body on the connection either.
        response = await head_then_body(conn, route.method, route.path, route.auth, b"{}")
        assert response.status < 500, response.body
        assert response.status not in (401, 403), response.body
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
    assert keyed.stack.emulator.received == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/responses"),  # names no session
        ("POST", f"/sessions/{SID}/v1/completions"),
        ("POST", f"/sessions/{SID}/v1/chat/completions/"),
        ("POST", f"/sessions/{SID}/x/v1/chat/completions"),
        ("GET", "/ui/missing.js"),
    ],
    ids=["root-no-session", "session-completions", "chat-slash", "chat-two-segments", "ui-asset"],
)
async def test_unknown_paths_are_404_and_the_connection_kept(
    keyed: Keyed, method: str, path: str
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
        Settings(workers=(stack.emulator_url,), port=0),
        tokenizer=chat_tokenizers["chatml"],
        worker_tls=TLS,
    )
    server = await start_server(nursery, app, root_path=ROOT)
    yield server.url
    await server.aclose()


async def test_a_chat_turn_under_a_root_path(rooted_url: str) -> None:
    async with httpx.AsyncClient(base_url=rooted_url + ROOT, timeout=STALL_S, verify=TLS) as client:
        created = await client.post("/sessions", json={})
        assert created.status_code == 201, created.text
        chat_url = created.json()["base_url"] + "/chat/completions"
        messages = [{"role": "user", "content": "hi"}]
        turn = await client.post(chat_url, json={"messages": messages})
        assert turn.status_code == 200, turn.text
        assert turn.json()["choices"][0]["message"]["content"]
        session = (await client.get(created.json()["base_url"].removesuffix("/v1"))).json()
        assert session["num_turns"] == 1
    async with httpx.AsyncClient(base_url=rooted_url, timeout=STALL_S, verify=TLS) as outside:
        # Outside the root path nothing matches, the chat route included.
        missed = await outside.post(chat_url, json={"messages": messages})
        assert missed.status_code == 404
        assert missed.json()["error"]["code"] == "not_found"
