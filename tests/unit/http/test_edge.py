"""The HTTP edge called as an ASGI app, no server: the body timeout, a client
that goes away mid-body, and route matching under a ``root_path``."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import trio
import trio.testing
from werkzeug import exceptions as werkzeug_errors

from rollout_session import Settings, create_app
from rollout_session.client import rendezvous_owner
from rollout_session.http.edge import BODY_TIMEOUT_S, error_response, route_path
from tests.loopback import TLS

CHAT = "/sessions/s/v1/chat/completions"
KEY = "k"


@pytest.mark.parametrize(
    ("path", "root_path", "expected"),
    [
        ("/sessions", "", "/sessions"),
        ("/api/sessions", "/api", "/sessions"),
        ("/sessions", "/api", None),
        ("/api", "/api", None),
    ],
    ids=["no-root", "below-root", "outside-root", "the-root-itself"],
)
def test_route_path(path: str, root_path: str, expected: str | None) -> None:
    assert route_path({"path": path, "root_path": root_path}) == expected  # type: ignore[typeddict-item]


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (werkzeug_errors.NotFound(), 404, "not_found"),
        (werkzeug_errors.MethodNotAllowed(), 405, "method_not_allowed"),
        (werkzeug_errors.RequestEntityTooLarge(), 413, "request_too_large"),
        (werkzeug_errors.BadRequest("bad form"), 400, "invalid_request"),
        (RuntimeError("secret detail"), 500, "internal_error"),
    ],
    ids=["404", "405", "413", "400", "unexpected"],
)
def test_errors_render_as_openai_errors(exc: Exception, status: int, code: str) -> None:
    # What Quart or werkzeug raise in a handler gets the same body as ours.
    response = error_response(exc)
    assert response.status == status
    error = orjson.loads(response.body)["error"]
    assert error["code"] == code and "secret" not in error["message"]
    assert (b"content-type", b"application/json") in response.headers


def _scope(method: str, path: str, *, root_path: str = "", key: bool = True) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")]
    if key:
        headers.append((b"authorization", f"Bearer {KEY}".encode()))
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": root_path,
        "headers": headers,
    }


class Exchange:
    """One request to the edge: what it receives, and what it sends back."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self._messages = iter(messages)
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        for message in self._messages:
            return message
        await trio.sleep_forever()  # a client that stops sending
        raise AssertionError

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def run(self, scope: dict[str, Any]) -> None:
        app = create_app(Settings(workers=("http://127.0.0.1:9",), api_key=KEY), worker_tls=TLS)
        await app.asgi_app(scope, self.receive, self.send)  # type: ignore[arg-type]

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])


@pytest.mark.parametrize(
    ("method", "path", "key", "status"),
    [
        ("POST", CHAT, True, 400),
        ("POST", "/sessions", True, 400),
        ("POST", CHAT, False, 401),
        ("POST", "/v1/responses", True, 404),
    ],
    ids=["chat", "quart-route", "unauthorized", "unknown-route"],
)
async def test_a_stalled_body_times_out_and_closes(
    autojump_clock: trio.testing.MockClock, method: str, path: str, key: bool, status: int
) -> None:
    exchange = Exchange([{"type": "http.request", "body": b"{", "more_body": True}])
    started = trio.current_time()
    await exchange.run(_scope(method, path, key=key))
    assert trio.current_time() - started == pytest.approx(BODY_TIMEOUT_S)
    assert exchange.status == status
    assert exchange.headers[b"connection"] == b"close"
    if status == 400:
        assert b"did not arrive" in exchange.sent[1]["body"]


@pytest.mark.parametrize("path", [CHAT, "/sessions", "/v1/responses"], ids=["chat", "quart", "404"])
async def test_a_client_gone_mid_body_is_not_answered(path: str) -> None:
    exchange = Exchange(
        [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]
    )
    await exchange.run(_scope("POST", path))
    assert exchange.sent == []


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/api" + CHAT, 405),  # the chat route, matched below the root
        ("POST", CHAT, 404),  # outside the root
        ("PATCH", "/api/sessions", 405),  # Quart's routes alike
        ("PATCH", "/sessions", 404),
    ],
    ids=["chat-below-root", "chat-outside-root", "quart-below-root", "quart-outside-root"],
)
async def test_routes_are_matched_below_the_root_path(method: str, path: str, status: int) -> None:
    exchange = Exchange([{"type": "http.request", "body": b"", "more_body": False}])
    await exchange.run(_scope(method, path, root_path="/api"))
    assert exchange.status == status
    assert b"connection" not in exchange.headers


FLEET = ("http://127.0.0.1:9001", "http://127.0.0.1:9002")


def _session_owned_by(shard: int) -> str:
    return next(f"s{i}" for i in range(1000) if rendezvous_owner(FLEET, f"s{i}") == FLEET[shard])


@pytest.mark.parametrize(
    ("key", "shard", "status"),
    [(True, 1, 307), (False, 1, 401), (True, 0, 404)],
    ids=["elsewhere", "elsewhere-without-key", "here"],
)
async def test_a_fleet_shard_redirects_after_the_key_check(
    key: bool, shard: int, status: int
) -> None:
    """A session another shard owns: 307 to it once the key is checked, body
    read (the connection goes on); one owned here is served (here: unknown)."""
    session_id = _session_owned_by(shard)
    path = f"/sessions/{session_id}"
    exchange = Exchange([{"type": "http.request", "body": b"{}", "more_body": False}])
    app = create_app(
        Settings(workers=("http://127.0.0.1:9",), api_key=KEY, fleet=FLEET), worker_tls=TLS
    )
    scope = {
        **_scope("GET", path, key=key),
        "query_string": b"a=1",
        "raw_path": path.encode(),
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 9001),
        "client": ("127.0.0.1", 50000),
    }
    await app.asgi_app(scope, exchange.receive, exchange.send)  # type: ignore[arg-type]
    assert exchange.status == status
    if status == 307:
        assert exchange.headers[b"location"] == f"{FLEET[1]}{path}?a=1".encode()
        assert b"connection" not in exchange.headers
