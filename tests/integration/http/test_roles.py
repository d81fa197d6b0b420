"""Roles over real HTTP: which key reaches which route (docs/security.md).

A session's key (``api_key`` in the answer to ``POST /sessions``) reaches
that session's model routes and nothing else; the trainer's key
(``--api-key``) every route but the operator's; the operator's key
(``--admin-api-key``) every route. The keys are derived, so they survive a
restart on the journal; the scheme of the header is case-insensitive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from rollout_session import Settings, create_app
from rollout_session.client import SessionClient
from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.http.serving import start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import Stack, StackFactory, agent_turn, spawn_worker
from tests.loopback import TLS

KEY = "trainer-key"
ADMIN = "operator-key"
USER = [{"role": "user", "content": "hi"}]

# Every route a trainer uses, for a session `sid`: method, path, JSON body.
Route = tuple[str, str, dict[str, Any] | None]
TRAINER_ROUTES: list[Route] = [
    ("POST", "/sessions", {}),
    ("GET", "/sessions", None),
    ("GET", "/sessions/{sid}", None),
    ("GET", "/sessions/{sid}/trajectory", None),
    ("GET", "/sessions/{sid}/diff", None),
    ("POST", "/sessions/{sid}/rescore", {"target": "pinned", "label": "t"}),
    ("DELETE", "/sessions/{sid}", None),
]
OPERATOR_ROUTES: list[Route] = [
    ("GET", "/workers", None),
    ("POST", "/workers", {"url": "http://127.0.0.1:9"}),
    ("DELETE", "/workers?url=http://127.0.0.1:9", None),
    ("POST", "/admin/pause", None),
    ("POST", "/admin/resume", None),
    ("GET", "/metrics", None),
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def create(stack: Stack, session_id: str) -> str:
    """Create `session_id` with the trainer's key; its own key."""
    response = await stack.client.post("/sessions", json={"session_id": session_id})
    assert response.status_code == 201, response.text
    key = response.json()["api_key"]
    assert isinstance(key, str)
    return key


async def request(
    client: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None
) -> httpx.Response:
    return await client.request(method, path, json=body)


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, (response.request.url, response.text)
    assert response.json()["error"]["code"] == code


@pytest.fixture
async def roles(make_stack: StackFactory) -> Stack:
    return await make_stack(api_key=KEY, admin_api_key=ADMIN)


async def test_an_agent_key_reaches_its_own_session_and_nothing_else(roles: Stack) -> None:
    own = await create(roles, "mine")
    other = await create(roles, "theirs")
    assert own != other and KEY not in own and ADMIN not in own
    base = f"{roles.url}/sessions"
    assert await trio.to_thread.run_sync(agent_turn, f"{base}/mine/v1", own)
    with pytest.raises(openai.AuthenticationError):
        await trio.to_thread.run_sync(agent_turn, f"{base}/theirs/v1", own)
    async with httpx.AsyncClient(base_url=roles.url, headers=bearer(own), verify=TLS) as agent:
        assert (await agent.get("/sessions/mine/v1/models")).status_code == 200
        assert_error(await agent.get("/sessions/theirs/v1/models"), 401, "unauthorized")
        for method, path, body in TRAINER_ROUTES + OPERATOR_ROUTES:
            for sid in ("mine", "theirs"):
                response = await request(agent, method, path.format(sid=sid), body)
                assert_error(response, 401, "unauthorized")
    # Nothing the agent was refused happened.
    assert roles.emulator.received == 1
    assert roles.ctx.registry.get("mine").summary()["num_turns"] == 1
    assert roles.ctx.registry.get("theirs").summary()["num_turns"] == 0
    assert len(roles.ctx.registry) == 2
    assert [w.url for w in roles.ctx.pool.workers.values()] == [roles.emulator_url]
    assert not roles.ctx.pause.paused
    # The trainer's key reaches any session's model routes.
    assert (await roles.client.get("/sessions/theirs/v1/models")).status_code == 200


async def test_the_trainer_key_cannot_reach_operator_routes_when_an_admin_key_is_set(
    roles: Stack,
) -> None:
    for method, path, body in OPERATOR_ROUTES:
        response = await request(roles.client, method, path, body)
        assert_error(response, 403, "permission_denied")
        assert response.json()["error"]["type"] == "permission_error"
    assert [w.url for w in roles.ctx.pool.workers.values()] == [roles.emulator_url]
    # The operator's key reaches them, and every other route.
    async with httpx.AsyncClient(base_url=roles.url, headers=bearer(ADMIN), verify=TLS) as operator:
        assert (await operator.get("/workers")).status_code == 200
        assert (await operator.get("/metrics")).status_code == 200
        assert (await operator.post("/admin/pause")).json() == {
            "paused": True,
            "mode": "drain",
            "inflight": 0,
            "interrupted": 0,
            "waiting": 0,
        }
        resumed = await operator.post("/admin/resume")
        assert resumed.json() == {"paused": False, "weight_version": None}
        assert (await operator.post("/sessions", json={"session_id": "s"})).status_code == 201
        assert (await operator.get("/sessions/s")).status_code == 200
        assert (await operator.get("/sessions/s/v1/models")).status_code == 200


async def test_without_an_admin_key_the_trainer_key_is_the_operators(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(api_key=KEY)
    own = await create(stack, "s")
    assert (await stack.client.get("/workers")).status_code == 200
    assert (await stack.client.get("/metrics")).status_code == 200
    async with httpx.AsyncClient(base_url=stack.url, headers=bearer(own), verify=TLS) as agent:
        assert_error(await agent.get("/workers"), 401, "unauthorized")
        assert_error(await agent.get("/metrics"), 401, "unauthorized")


async def test_an_admin_key_alone_guards_the_operator_routes_only(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(admin_api_key=ADMIN)
    created = await stack.client.post("/sessions", json={"session_id": "s"})
    assert created.status_code == 201
    assert created.json()["api_key"] is None  # no trainer key: sessions have none
    assert (await stack.chat("s", messages=USER)).status_code == 200
    for method, path, body in OPERATOR_ROUTES:
        assert_error(await request(stack.client, method, path, body), 401, "unauthorized")
    assert (await stack.client.get("/workers", headers=bearer(ADMIN))).status_code == 200


async def test_without_keys_sessions_have_none(stack: Stack) -> None:
    created = await stack.client.post("/sessions", json={"session_id": "s"})
    assert created.json()["api_key"] is None
    assert (await stack.client.get("/sessions/s")).json()["api_key"] is None


@pytest.mark.parametrize(
    "scheme",
    ["bearer", "BEARER", "Bearer ", "bEaReR"],
    ids=["lower", "upper", "two-spaces", "mixed"],
)
async def test_the_scheme_is_case_insensitive(roles: Stack, scheme: str) -> None:
    own = await create(roles, "s")
    async with httpx.AsyncClient(base_url=roles.url, verify=TLS) as bare:
        for key, path, status in (
            (KEY, "/sessions", 200),
            (ADMIN, "/workers", 200),
            (own, "/sessions/s/v1/models", 200),
        ):
            response = await bare.get(path, headers={"Authorization": f"{scheme} {key}"})
            assert response.status_code == status, (scheme, path, response.text)
        for header in (f"Basic {KEY}", KEY, f"Bearer{KEY}", "Bearer"):
            response = await bare.get("/sessions", headers={"Authorization": header})
            assert_error(response, 401, "unauthorized")


async def test_session_keys_survive_a_restart_with_the_journal(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    tmp_path: Path,
) -> None:
    worker = await spawn_worker(nursery, text_model, EmulatorConfig())

    async def boot(api_key: str) -> tuple[str, Any]:
        settings = Settings(workers=(worker.url,), journal=str(tmp_path), api_key=api_key)
        app = create_app(settings, tokenizer=chat_tokenizers["chatml"], worker_tls=TLS)
        server = await start_server(nursery, app)
        return server.url, server

    url, server = await boot(KEY)
    async with httpx.AsyncClient(base_url=url, headers=bearer(KEY), verify=TLS) as trainer:
        created = await trainer.post("/sessions", json={"session_id": "episode"})
    own = created.json()["api_key"]
    assert await trio.to_thread.run_sync(agent_turn, f"{url}/sessions/episode/v1", own)
    await server.aclose()

    url, server = await boot(KEY)  # the same key: the session's key still works
    assert await trio.to_thread.run_sync(agent_turn, f"{url}/sessions/episode/v1", own)
    async with httpx.AsyncClient(base_url=url, headers=bearer(KEY), verify=TLS) as trainer:
        assert (await trainer.get("/sessions/episode")).json()["api_key"] == own
    await server.aclose()

    url, server = await boot("rotated-key")  # a new trainer key revokes it
    with pytest.raises(openai.AuthenticationError):
        await trio.to_thread.run_sync(agent_turn, f"{url}/sessions/episode/v1", own)
    await server.aclose()


class LoseFirstCreateAnswer(httpx.AsyncBaseTransport):
    """The first ``POST /sessions`` reaches the server; its answer is lost."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.lost = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if request.method == "POST" and not self.lost:
            self.lost += 1
            await response.aclose()
            raise httpx.ReadError("the answer was lost", request=request)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


@pytest.mark.parametrize("lose_answer", [False, True], ids=["answered", "answer-lost"])
async def test_session_client_hands_the_agent_its_session_key(
    roles: Stack, lose_answer: bool
) -> None:
    transport = LoseFirstCreateAnswer() if lose_answer else None
    async with SessionClient([roles.url], api_key=KEY, backoff_s=0, transport=transport) as client:
        handle = await client.create("episode")
        assert handle.api_key is not None and handle.api_key != KEY
        assert await trio.to_thread.run_sync(agent_turn, handle.base_url, handle.api_key)
        doc = await client.close(handle.session_id)
    assert len(doc["segments"][0]["turns"]) == 1
    assert transport is None or transport.lost == 1
