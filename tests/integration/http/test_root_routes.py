"""One base URL for all rollouts (docs/api.md#one-base-url-for-all-rollouts):
the model routes at the root, a session named by its header or its key."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.conftest import TOOLS, Stack, StackFactory
from tests.integration.conftest import closed_after_test
from tests.integration.protocols.test_sdk import MODEL
from tests.integration.session.test_turns import check_document, echo
from tests.loopback import TLS

pytestmark = pytest.mark.usefixtures("close_sdk_clients")

USER = [{"role": "user", "content": "What does main.py print?"}]


def root_client(stack: Stack, **headers: str) -> openai.AsyncOpenAI:
    """An SDK client on the server's one base URL (`{server}/v1`)."""
    return closed_after_test(
        openai.AsyncOpenAI(
            base_url=f"{stack.url}/v1",
            api_key=headers.pop("api_key", "unused"),
            max_retries=0,
            default_headers=headers,
            http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
        )
    )


async def episode(agent: openai.AsyncOpenAI, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = list(USER)
    for i in range(turns):
        completion = await agent.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            seed=i,
        )
        message = completion.choices[0].message.model_dump(exclude_none=True)
        messages.append(echo(message))
        for call in message.get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"r{i}"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": f"next {i}"})
    return messages


async def test_a_root_episode_is_the_session_routes_episode(make_stack: StackFactory) -> None:
    """The same conversation through /v1 + X-Session-ID and through
    /sessions/{id}/v1 gives the same trajectory."""
    docs = []
    for root in (True, False):
        stack = await make_stack()
        session_id = await stack.create(session_id="episode")
        if root:
            agent = root_client(stack, **{"X-Session-ID": session_id})
        else:
            agent = openai.AsyncOpenAI(
                base_url=f"{stack.url}/sessions/{session_id}/v1",
                api_key="x",
                max_retries=0,
                http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
            )
            closed_after_test(agent)
        await episode(agent, turns=3)
        doc = await stack.trajectory(session_id)
        check_document(doc)
        docs.append((doc["token_ids"], doc["loss_mask"], doc["logprobs"], len(doc["turns"])))
    assert docs[0] == docs[1] and docs[0][3] == 3


async def test_concurrent_rollouts_on_one_base_url_never_collide(stack: Stack) -> None:
    ids = [f"rollout-{i}" for i in range(8)]
    for session_id in ids:
        await stack.create(session_id=session_id)

    async with trio.open_nursery() as nursery:
        for session_id in ids:
            nursery.start_soon(episode, root_client(stack, **{"X-Session-ID": session_id}), 3)
    for session_id in ids:
        doc = await stack.trajectory(session_id)
        check_document(doc)
        assert len(doc["turns"]) == 3 and doc["num_segments"] == 1


async def test_the_same_id_twice_at_once_is_409_as_on_the_session_route(
    make_stack: StackFactory,
) -> None:
    from rollout_session.emulator import EmulatorConfig

    stack = await make_stack(emulator=EmulatorConfig(base_latency_s=0.5))
    session_id = await stack.create()
    answers: list[httpx.Response] = []

    async def call() -> None:
        answers.append(
            await stack.client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": USER},
                headers={"X-Session-ID": session_id},
            )
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        nursery.start_soon(call)
    assert sorted(a.status_code for a in answers) == [200, 409]
    busy = next(a for a in answers if a.status_code == 409)
    assert busy.json()["error"]["code"] == "session_busy"


@pytest.mark.parametrize(
    ("headers", "status", "code", "param"),
    [
        ({"X-Session-ID": "nobody"}, 404, "session_not_found", None),
        ({"X-Session-ID": "has space"}, 400, "invalid_request", "X-Session-ID"),
        ({}, 404, "not_found", None),
    ],
    ids=["unknown-id", "bad-id", "no-session"],
)
async def test_a_root_request_naming_no_session_it_can_reach(
    stack: Stack, headers: dict[str, str], status: int, code: str, param: str | None
) -> None:
    body = {"model": MODEL, "messages": USER}
    response = await stack.client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    if not headers:
        assert "X-Session-ID" in error["message"]
    assert stack.emulator.received == 0
    assert len(stack.ctx.registry) == 0


async def test_auto_create_sessions_creates_an_unknown_id_with_its_metadata(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(auto_create_sessions=True)
    agent = root_client(
        stack,
        **{"X-Session-ID": "fresh", "X-Session-Metadata": json.dumps({"task": 7})},
    )
    await episode(agent, turns=2)
    doc = await stack.trajectory("fresh")
    assert doc["metadata"] == {"task": 7} and len(doc["turns"]) == 2
    # A collected id is not created again: a late agent gets 404.
    assert (await stack.client.delete("/sessions/fresh")).status_code == 200
    late = await stack.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER},
        headers={"X-Session-ID": "fresh"},
    )
    assert late.status_code == 404
    # Metadata that is not a JSON object is refused, and nothing is created.
    bad = await stack.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER},
        headers={"X-Session-ID": "other", "X-Session-Metadata": "[1]"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Session-Metadata"
    assert stack.ctx.registry.find("other") is None


async def test_a_session_key_names_its_session_at_the_root(make_stack: StackFactory) -> None:
    stack = await make_stack(api_key="trainer")
    mine = (await stack.client.post("/sessions", json={"session_id": "mine"})).json()
    await stack.client.post("/sessions", json={"session_id": "theirs"})
    # The session's key alone selects it: no header.
    await episode(root_client(stack, api_key=mine["api_key"]), turns=2)
    assert len((await stack.trajectory("mine"))["turns"]) == 2
    # Its key does not reach another session by naming it in the header.
    response = await stack.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER},
        headers={"X-Session-ID": "theirs", "Authorization": f"Bearer {mine['api_key']}"},
    )
    assert response.status_code == 401
    # The trainer's key with the header reaches any session.
    await episode(root_client(stack, api_key="trainer", **{"X-Session-ID": "theirs"}), turns=1)
    assert len((await stack.trajectory("theirs"))["turns"]) == 1


async def test_models_at_the_root(make_stack: StackFactory) -> None:
    stack = await make_stack(session_header="X-Rollout")
    session_id = await stack.create()
    for headers in ({}, {"X-Rollout": session_id}):
        listed = await root_client(stack, **headers).models.list()
        assert [m.id for m in listed.data] == [MODEL]
    unknown = await stack.client.get("/v1/models", headers={"X-Rollout": "nobody"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "session_not_found"


@pytest.mark.parametrize(
    ("path", "hint"),
    [
        ("/sessions/{id}/v1/messages/batches", "POST /v1/messages, POST /v1/messages/count_tokens"),
        ("/sessions/{id}/v1/embeddings", "POST /v1/responses"),
        ("/v1/embeddings", "POST /v1/chat/completions"),
    ],
    ids=["session-message-batches", "session-other", "root-other"],
)
async def test_an_unknown_model_route_is_404_naming_the_routes(
    stack: Stack, path: str, hint: str
) -> None:
    session_id = await stack.create()
    response = await stack.client.post(
        path.format(id=session_id), json={"input": "hi"}, headers={"X-Session-ID": session_id}
    )
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "not_found" and hint in error["message"]
    assert "GET /v1/models, POST /v1/chat/completions, POST /v1/responses" in error["message"]
