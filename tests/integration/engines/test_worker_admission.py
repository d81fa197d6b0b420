"""Who may be a worker: a URL that is only scheme://host[:port][/path], on an
allowed host, that answers as an SGLang worker serving the served model.

A worker joins unhealthy (``joining``) and takes no session until its
admission check passed; an HTTP server that is not SGLang, or an SGLang
worker serving another model, never gets one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import orjson
import pytest
import trio
from quart import Response, request
from quart_trio import QuartTrio

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.engines.pool import Health
from rollout_session.http.app import server_context
from rollout_session.http.serving import RunningServer, start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import Stack, StackFactory, spawn_worker
from tests.loopback import TLS

USER = [{"role": "user", "content": "hello"}]
# Probes every 50 ms: admission checks come quickly, so waiting on them is short.
FAST: dict[str, Any] = {"health_interval_s": 0.05, "health_timeout_s": 1.0}

REFUSED = {
    "query-and-fragment": "http://127.0.0.1:{port}/internal/admin?token=x#",
    "fragment-hides-path": "http://127.0.0.1:{port}/internal/admin#",
    "query": "http://127.0.0.1:{port}?next=/admin",
    "userinfo": "http://admin:pw@127.0.0.1:{port}",
    "dot-segments": "http://127.0.0.1:{port}/v1/../../admin",
    "percent-escape": "http://127.0.0.1:{port}/%2e%2e/admin",
    "short-ipv4": "http://127.1:{port}",
    "crlf": "http://127.0.0.1:{port}/\r\nHost: evil",
    "not-http": "file:///etc/passwd",
    "too-long": "http://127.0.0.1:{port}/" + "a" * 2048,
}


@pytest.mark.parametrize("shape", REFUSED.values(), ids=REFUSED.keys())
async def test_post_workers_refuses_urls_that_are_not_a_base_url(
    make_stack: StackFactory, shape: str
) -> None:
    stack = await make_stack()
    url = shape.format(port=stack.workers[0].port)
    response = await stack.client.post("/workers", json={"url": url})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "url")
    assert list(stack.ctx.pool.workers) == [stack.emulator_url]


async def test_post_workers_honours_the_host_allow_list(
    make_stack: StackFactory, text_model: TextModel, nursery: trio.Nursery
) -> None:
    stack = await make_stack(worker_hosts=frozenset({"127.0.0.0/8"}))
    other = await spawn_worker(nursery, text_model, EmulatorConfig())
    # A name is never resolved into an allowed network.
    by_name = f"http://localhost:{other.port}"
    refused = await stack.client.post("/workers", json={"url": by_name})
    assert refused.status_code == 400
    assert "--worker-hosts" in refused.json()["error"]["message"]
    assert (await stack.client.post("/workers", json={"url": other.url})).status_code == 201
    assert sorted(stack.ctx.pool.workers) == sorted([stack.emulator_url, other.url])


async def run_turns(stack: Stack, sessions: int) -> list[str]:
    ids = [await stack.create() for _ in range(sessions)]
    for session_id in ids:
        response = await stack.chat(session_id, messages=USER)
        assert response.status_code == 200, response.text
    return ids


async def test_a_worker_of_another_model_is_refused_when_added(
    make_stack: StackFactory, text_model: TextModel, nursery: trio.Nursery
) -> None:
    stack = await make_stack(**FAST)
    pool = stack.ctx.pool
    # An SGLang worker, but of another model: refused at once, with the reason.
    other = await spawn_worker(nursery, text_model, EmulatorConfig(model_name="other/model"))
    refused = await stack.client.post("/workers", json={"url": other.url})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "url"
    assert "serves other/model, not rollout-session/emulator" in error["message"]
    assert not pool.knows(other.url)
    await run_turns(stack, 3)
    assert other.emulator.received == 0
    assert (await stack.client.get("/health")).json()["workers"] == {"healthy": 1, "total": 1}
    # A worker that does not answer yet (starting) joins the pool, and takes
    # no session until it answers as a worker of the served model.
    other.kill()
    added = await stack.client.post("/workers", json={"url": other.url})
    assert added.status_code == 201, added.text
    assert added.json()["state"] == "joining" and not added.json()["healthy"]
    await run_turns(stack, 2)
    assert pool.get(other.url).active_sessions == 0
    text_template = stack.emulator.config.chat_template
    same = await spawn_worker(
        nursery, text_model, EmulatorConfig(chat_template=text_template), port=other.port
    )
    with trio.fail_after(20):
        await pool.wait_for_health(other.url, healthy=True)
    assert pool.get(other.url).model == "rollout-session/emulator"
    # Least loaded, it takes the next session.
    await run_turns(stack, 1)
    assert same.emulator.received == 1


@dataclass
class Imposter:
    """An HTTP server that is not SGLang: it answers every path with one
    canned answer and counts the chat completions it is sent."""

    body: bytes
    content_type: str
    chats: int = 0
    paths: list[str] = field(default_factory=list)

    def app(self) -> QuartTrio:
        app = QuartTrio("imposter")

        @app.route("/<path:path>", methods=["GET", "POST"])
        async def anything(path: str) -> Response:
            self.paths.append(request.path)
            if request.path == "/v1/chat/completions":
                self.chats += 1
            return Response(self.body, content_type=self.content_type)

        return app


IMPOSTERS: dict[str, Callable[[], Imposter]] = {
    "json-ok-everywhere": lambda: Imposter(b'{"status": "ok"}', "application/json"),
    "html-everywhere": lambda: Imposter(b"<html>It works!</html>", "text/html"),
    # SGLang's own answers, but for an embedding model: no chat to serve.
    "embedding-model": lambda: Imposter(
        orjson.dumps(
            {
                "model_path": "rollout-session/emulator",
                "is_generation": False,
                "object": "list",
                "data": [{"id": "rollout-session/emulator"}],
            }
        ),
        "application/json",
    ),
}


@pytest.mark.parametrize("make_imposter", IMPOSTERS.values(), ids=IMPOSTERS.keys())
async def test_a_server_that_is_not_sglang_is_refused_when_added(
    make_stack: StackFactory, nursery: trio.Nursery, make_imposter: Callable[[], Imposter]
) -> None:
    stack = await make_stack(**FAST)
    imposter = make_imposter()
    server = await start_server(nursery, imposter.app())
    refused = await stack.client.post("/workers", json={"url": server.url})
    assert refused.status_code == 400, refused.text
    assert "cannot join" in refused.json()["error"]["message"]
    assert not stack.ctx.pool.knows(server.url)
    await run_turns(stack, 3)
    assert imposter.chats == 0
    assert "/health" in imposter.paths  # it was asked, and refused
    await server.aclose()


async def test_a_configured_worker_that_is_not_sglang_never_joins(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
) -> None:
    """Listed first, the imposter neither defines the served model nor gets
    a session; start-up learns the model from the real worker."""
    imposter = Imposter(b'{"status": "ok"}', "application/json")
    fake: RunningServer = await start_server(nursery, imposter.app())
    template = chat_tokenizers["chatml"]
    real = await spawn_worker(
        nursery, text_model, replace(EmulatorConfig(), chat_template=template.chat_template)
    )
    app = create_app(
        Settings(workers=(fake.url, real.url), port=0, **FAST), tokenizer=template, worker_tls=TLS
    )
    server = await start_server(nursery, app)
    ctx = server_context(app)
    states: dict[str, Any] = {w.url: w.health for w in ctx.pool.workers.values()}
    assert states == {fake.url: Health.JOINING, real.url: Health.HEALTHY}
    assert ctx.model.info is not None and ctx.model.info.model == "rollout-session/emulator"
    async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
        for _ in range(3):
            session_id = (await client.post("/sessions")).json()["session_id"]
            path = f"/sessions/{session_id}/v1/chat/completions"
            assert (await client.post(path, json={"messages": USER})).status_code == 200
    assert imposter.chats == 0 and real.emulator.received == 3
    await server.aclose()
    await fake.aclose()


async def workerless(
    nursery: trio.Nursery, template: ChatTokenizer, **settings: Any
) -> tuple[httpx.AsyncClient, Any, RunningServer]:
    """A session server started without workers (a trainer's join by POST
    /workers): the engine and the tokenizer named."""
    app = create_app(
        Settings(workers=(), tokenizer="unused: the app is given it", port=0, **FAST, **settings),
        tokenizer=template,
        worker_tls=TLS,
    )
    server = await start_server(nursery, app)
    return httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS), app, server


@pytest.mark.parametrize(
    "flag", [True, None, False], ids=["flag-agrees", "learned", "flag-contradicted"]
)
async def test_a_server_started_without_workers_takes_those_that_join(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    flag: bool | None,
) -> None:
    """A worker launched as verl launches SGLang (``--skip-tokenizer-init``,
    no parsers) joins a server started without workers, its answers' ids
    decoded here, whether ``--skip-tokenizer-init true`` said so or the
    first worker taught it (then every later worker must run the same); a
    flag it contradicts refuses it, naming the setting."""
    template = chat_tokenizers["chatml"]

    async def worker(skip: bool) -> Any:
        config = EmulatorConfig(skip_tokenizer_init=skip, chat_template=template.chat_template)
        return await spawn_worker(nursery, text_model, config, parsers=False)

    first = await worker(True)
    client, app, server = await workerless(
        nursery,
        template,
        engine="sglang-generate",
        tool_call_parser="qwen25",
        skip_tokenizer_init=flag,
    )
    async with client:
        assert (await client.post("/sessions")).status_code == 201  # sessions before workers
        joined = await client.post("/workers", json={"url": first.url})
        if flag is False:
            assert joined.status_code == 400
            assert "runs --skip-tokenizer-init, where this server expects no" in joined.text
        else:
            assert joined.status_code == 201, joined.text
            await run_turns(Stack(server.url, server_context(app), [first], client, server), 2)
            other = await client.post("/workers", json={"url": (await worker(False)).url})
            assert other.status_code == 400
            assert "where the pool's workers run --skip-tokenizer-init" in other.text or (
                flag and "where this server expects --skip-tokenizer-init" in other.text
            )
    await server.aclose()  # graceful: the app closes its worker clients


async def test_a_vllm_server_started_without_workers_learns_their_sampling_defaults(
    nursery: trio.Nursery, text_model: TextModel, chat_tokenizers: dict[str, ChatTokenizer]
) -> None:
    """vLLM publishes no launch settings: a server started without workers
    takes the first joining worker's rendered sampling defaults (verl's
    override_generation_config here) and samples every turn with them; a
    worker with other defaults, or one whose rendering contradicts the
    parser flags, is refused naming why."""
    template = chat_tokenizers["chatml"]

    async def worker(**config: Any) -> Any:
        base = EmulatorConfig(
            engine="vllm", enable_scale_out=True, chat_template=template.chat_template
        )
        return await spawn_worker(nursery, text_model, replace(base, **config))

    override = {"temperature": 0.5, "top_p": 0.8}
    first = await worker(override_generation_config=override)
    client, app, server = await workerless(nursery, template, engine="vllm")
    async with client:
        joined = await client.post("/workers", json={"url": first.url})
        assert joined.status_code == 201, joined.text
        stack = Stack(server.url, server_context(app), [first], client, server)
        [session_id] = await run_turns(stack, 1)
        [turn] = (await stack.trajectory(session_id, schema=3))["segments"][0]["turns"]
        assert (turn["sampling"]["temperature"], turn["sampling"]["top_p"]) == (0.5, 0.8)
        other = await client.post("/workers", json={"url": (await worker()).url})
        assert other.status_code == 400 and "sampling defaults" in other.text, other.text
        parsing = await worker(override_generation_config=override, tool_call_parser="hermes")
        refused = await client.post("/workers", json={"url": parsing.url})
        assert refused.status_code == 400 and "--tool-call-parser" in refused.text, refused.text
    await server.aclose()
