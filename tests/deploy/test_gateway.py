"""The session server behind the real SGLang gateway, `smg` from PyPI, in
front of emulator workers (docs/deploy.md#behind-smg-the-sglang-gateway).

smg runs as its own process (`python -m smg launch`, the command deploy.md
gives) on free loopback ports. Skipped when smg is not installed (it is the
`gateway` extra), unless ROLLOUT_SESSION_REQUIRE_GATEWAY is set, as in CI:
then that fails instead.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.engines.resolve import resolve_engine
from rollout_session.http.app import server_context
from rollout_session.http.serving import start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import TOOLS, Stack, StackFactory, Worker, spawn_worker
from tests.integration.session.test_turns import check_document, echo
from tests.loopback import TLS

SERVED = EmulatorConfig().model_name
# Each gateway test starts smg; its start-up and worker registration take a second or two.
START_TIMEOUT_S = 60


def _require_smg() -> None:
    if importlib.util.find_spec("smg") is not None:
        return
    reason = (
        "smg (the SGLang gateway, PyPI) is not installed: pip install 'rollout-session[gateway]'"
    )
    if os.environ.get("ROLLOUT_SESSION_REQUIRE_GATEWAY"):
        pytest.fail(f"ROLLOUT_SESSION_REQUIRE_GATEWAY is set, but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    # smg takes a port number, not a listening socket: the tiny window between
    # closing this one and smg binding it is the price.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _kill(process: trio.Process) -> None:
    process.kill()


@dataclass
class Gateway:
    url: str
    client: httpx.AsyncClient

    async def workers(self) -> dict[str, bool]:
        """smg's view: worker URL → healthy."""
        listed = (await self.client.get("/workers")).json()["workers"]
        return {w["url"]: bool(w["is_healthy"]) and w["status"] == "ready" for w in listed}

    async def wait_for(self, expected: dict[str, bool]) -> None:
        """Until smg sees exactly these workers in these states. smg is another
        process with no event to wait on: its /workers is polled."""
        with trio.fail_after(START_TIMEOUT_S):
            while await self.workers() != expected:  # noqa: ASYNC110 (no event to wait on)
                await trio.sleep(0.05)


async def start_smg(nursery: trio.Nursery, worker_urls: list[str], log: Path) -> Gateway:
    """smg as docs/deploy.md starts it, with health checks every second (its
    default is 60 s) so that a dead worker is seen within the test."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "smg",
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "manual",
        "--assignment-mode",
        "min_load",
        "--worker-urls",
        *worker_urls,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(_free_port()),
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warn",
    ]
    with log.open("wb") as sink:
        await nursery.start(
            functools.partial(
                trio.run_process,
                command,
                stdout=sink,
                stderr=subprocess.STDOUT,
                check=False,
                # It keeps serving through a grace period after SIGTERM; it
                # has nothing to save here.
                deliver_cancel=_kill,
            )
        )
    url = f"http://127.0.0.1:{port}"
    client = httpx.AsyncClient(base_url=url, timeout=10, trust_env=False, verify=TLS)
    gateway = Gateway(url, client)
    with trio.fail_after(START_TIMEOUT_S):
        while True:
            try:
                await gateway.wait_for({u: True for u in worker_urls})
                break
            except httpx.TransportError:  # not listening yet
                await trio.sleep(0.05)
    return gateway


GatewayFactory = Callable[..., Awaitable[tuple[Stack, Gateway]]]


@pytest.fixture
async def behind_smg(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    tmp_path: Path,
) -> AsyncIterator[GatewayFactory]:
    """Emulator workers (the same seed: same answers wherever a turn lands),
    smg in front of them, the session server in front of smg."""
    _require_smg()
    opened: list[Any] = []

    async def factory(
        num_workers: int = 2, emulator: EmulatorConfig | None = None, **settings: Any
    ) -> tuple[Stack, Gateway]:
        config = replace(
            emulator or EmulatorConfig(), chat_template=chat_tokenizers["chatml"].chat_template
        )
        workers = [await spawn_worker(nursery, text_model, config) for _ in range(num_workers)]
        gateway = await start_smg(nursery, [w.url for w in workers], tmp_path / "smg.log")
        opened.append(gateway.client)
        app_settings = Settings(workers=(gateway.url,), port=0, **settings)
        app = create_app(app_settings, tokenizer=chat_tokenizers["chatml"], worker_tls=TLS)
        server = await start_server(nursery, app, max_connections=app_settings.max_connections)
        opened.append(server)
        client = httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS)
        opened.append(client)
        return Stack(server.url, server_context(app), workers, client, server), gateway

    yield factory
    for resource in reversed(opened):
        await resource.aclose()


class Agent:
    """A scripted tool-using agent with its own task; it writes `"model":
    "any"`, as agents do that do not know the served name."""

    def __init__(self, stack: Stack, session_id: str, task: int) -> None:
        self.stack = stack
        self.session_id = session_id
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"Task {task}: what does main.py print?"},
        ]
        self.turns = 0
        self.failures: list[dict[str, Any]] = []

    async def turn(self) -> httpx.Response:
        """One turn; on a 200 the answer and the next input join the history."""
        response = await self.stack.chat(
            self.session_id, model="any", messages=self.messages, tools=TOOLS, seed=self.turns
        )
        if response.status_code != 200:
            return response
        message = response.json()["choices"][0]["message"]
        self.messages.append(echo(message))
        for call in message.get("tool_calls") or []:
            self.messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": f"print({self.turns})"}
            )
        if not message.get("tool_calls"):
            self.messages.append({"role": "user", "content": f"Now file {self.turns}."})
        self.turns += 1
        return response

    async def turn_until_ok(self, attempts: int = 5) -> None:
        """A turn, repeated as an agent repeats a failed one."""
        for _ in range(attempts):
            response = await self.turn()
            if response.status_code == 200:
                return
            # A clear failure, nothing committed: the agent may repeat it.
            assert response.status_code in (502, 503, 504), response.text
            assert "error" in response.json()
            self.failures.append(response.json()["error"])
        raise AssertionError(f"session {self.session_id}: no turn in {attempts} attempts")


async def direct_replay(
    make_stack: StackFactory, agents: list[Agent], **settings: Any
) -> tuple[Stack, list[dict[str, Any]]]:
    """The same agents' conversations, the same number of turns, straight to
    one worker: the stack (its worker saw every request, in order) and the
    trajectories."""
    stack = await make_stack(emulator=EmulatorConfig(), **settings)
    docs = []
    for task, agent in enumerate(agents):
        replay = Agent(stack, await stack.create(), task)
        for _ in range(agent.turns):
            assert (await replay.turn()).status_code == 200
        docs.append(await stack.trajectory(replay.session_id))
    return stack, docs


def assert_same_trajectory(got: dict[str, Any], direct: dict[str, Any]) -> None:
    check_document(got)
    for key in ("token_ids", "loss_mask", "logprobs", "routed_experts", "messages"):
        assert got.get(key) == direct.get(key), key
    spans = ("prompt_start", "completion_start", "completion_end", "finish_reason")
    assert [[t[k] for k in spans] for t in got["turns"]] == [
        [t[k] for k in spans] for t in direct["turns"]
    ]


def without_call_index(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as smg passes them on: its schema has no tool-call `index`."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = message | {
                "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]
            }
        out.append(message)
    return out


def where_each_turn_went(workers: list[Worker]) -> dict[str, list[tuple[float, str]]]:
    """Session id → (arrival, worker URL) of every chat request the workers received."""
    seen: dict[str, list[tuple[float, str]]] = {}
    for worker in workers:
        for record in worker.emulator.requests:
            seen.setdefault(record.body["session_id"], []).append((record.arrival, worker.url))
    return {sid: sorted(arrivals) for sid, arrivals in seen.items()}


SETTINGS: dict[str, Any] = {
    "routed_experts": True,
    "kv_sessions": "hint",
    "chat_template_kwargs": {"enable_thinking": False},
}


async def test_smg_sessions_stick_arrive_intact_and_match_direct(
    behind_smg: GatewayFactory, make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stack, gateway = await behind_smg(**SETTINGS)
    # --engine auto: smg routes /generate but not the parse routes, so the
    # workers behind it are served on their chat route.
    assert stack.ctx.side.spec.name == "sglang-chat"
    agents = [Agent(stack, await stack.create(), task) for task in range(4)]
    for _ in range(3):
        async with trio.open_nursery() as nursery:
            for agent in agents:
                nursery.start_soon(agent.turn_until_ok, 1)
    docs = [await stack.trajectory(a.session_id) for a in agents]
    arrivals = where_each_turn_went(stack.workers)

    # Exact: the same tokens, mask, logprobs and experts as straight to a worker.
    direct, direct_docs = await direct_replay(make_stack, agents, **SETTINGS)
    for doc, direct_doc in zip(docs, direct_docs, strict=True):
        assert_same_trajectory(doc, direct_doc)

    worker_urls = {w.url for w in stack.workers}
    for agent, doc in zip(agents, docs, strict=True):
        went = [url for _, url in arrivals[agent.session_id]]
        # Sticky: every turn of a session on one worker behind the gateway,
        # and each turn records that worker, not the gateway.
        assert len(went) == 3 and len(set(went)) == 1 and went[0] in worker_urls
        assert [t["worker"] for t in doc["turns"]] == went
        # The pin is the gateway.
        summary = (await stack.client.get(f"/sessions/{agent.session_id}")).json()
        assert summary["worker"] == gateway.url

    # Everything the server sends reached the worker through smg, as it
    # reaches a worker directly, turn by turn: smg drops `no_stop_trim`
    # (false, SGLang's default, so nothing changes), adds `tool_choice`
    # ("auto", SGLang's default with tools) and re-serialises `messages`
    # (a tool call's `index` goes: the prompt is `input_ids`).
    direct_bodies = [r.body for r in direct.emulator.requests]
    via_smg = [
        record.body
        for agent in agents
        for _, record in sorted(
            (r.arrival, r)
            for w in stack.workers
            for r in w.emulator.requests
            if r.body["session_id"] == agent.session_id
        )
    ]
    assert len(via_smg) == len(direct_bodies) == 12
    varying = {"rid", "session_id", "no_stop_trim", "tool_choice"}
    for got, sent in zip(via_smg, direct_bodies, strict=True):
        assert {k: v for k, v in got.items() if k not in varying} == {
            k: v for k, v in sent.items() if k not in varying
        } | {"messages": without_call_index(sent["messages"])}
        assert (got.get("no_stop_trim"), sent["no_stop_trim"]) == (None, False)
        assert (got["tool_choice"], sent.get("tool_choice")) == ("auto", None)
    for body in via_smg:
        assert body["model"] == SERVED  # the agent wrote "any"
        assert body["return_routed_experts"] is True and body["return_meta_info"] is True
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert len({body["rid"] for body in via_smg}) == 12
    for worker in stack.workers:
        for record in worker.emulator.requests:
            assert record.headers.get("x-smg-routing-key") == record.body["session_id"]

    # smg has no /close_session: each close fails there, logged once.
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        for agent in agents:
            assert (await stack.client.delete(f"/sessions/{agent.session_id}")).status_code == 200
        pool = stack.ctx.pool
        failures = pool.workers[gateway.url].control_failures
        with trio.fail_after(10):
            await pool.wait_until(lambda: failures["POST /close_session"] == 4)
    logged = [r for r in caplog.records if "/close_session" in r.getMessage()]
    assert len(logged) == 1 and "answered 404" in logged[0].getMessage()


async def test_smg_worker_death_then_recovery_keeps_trajectories_exact(
    behind_smg: GatewayFactory,
    make_stack: StackFactory,
    text_model: TextModel,
    nursery: trio.Nursery,
) -> None:
    # A little latency, so that turns are in flight when a worker dies.
    stack, gateway = await behind_smg(emulator=EmulatorConfig(base_latency_s=0.2), **SETTINGS)
    agents = [Agent(stack, await stack.create(), task) for task in range(4)]

    async def everyone_takes_a_turn() -> None:
        async with trio.open_nursery() as turns:
            for agent in agents:
                turns.start_soon(agent.turn_until_ok)

    await everyone_takes_a_turn()
    first = {sid: went[0][1] for sid, went in where_each_turn_went(stack.workers).items()}
    # The worker with most sessions dies with turns in flight.
    victim = max(stack.workers, key=lambda w: sum(url == w.url for url in first.values()))
    survivor = next(w for w in stack.workers if w is not victim)
    async with trio.open_nursery() as turns:
        turns.start_soon(everyone_takes_a_turn)
        with trio.fail_after(10):
            await victim.emulator.wait_until(lambda: victim.emulator.inflight > 0)
        victim.kill()
    # Every session goes on, on the survivor (smg re-pins the dead worker's keys).
    await everyone_takes_a_turn()
    await gateway.wait_for({victim.url: False, survivor.url: True})
    # The victim comes back on its port, and smg takes it back.
    revived = await spawn_worker(nursery, text_model, victim.emulator.config, port=victim.port)
    await gateway.wait_for({victim.url: True, survivor.url: True})
    await everyone_takes_a_turn()

    assert victim.emulator.cancelled >= 1  # a turn was in flight when it died
    # smg returns a key to its first worker once that is back.
    assert revived.emulator.received >= 1
    prompts: dict[str, list[list[int]]] = {w.url: [] for w in stack.workers}
    for worker in (*stack.workers, revived):
        prompts[worker.url] += [r.body["input_ids"] for r in worker.emulator.requests]
    docs = [await stack.trajectory(a.session_id) for a in agents]
    _, direct_docs = await direct_replay(make_stack, agents, **SETTINGS)
    for doc, direct_doc in zip(docs, direct_docs, strict=True):
        assert_same_trajectory(doc, direct_doc)
        assert len(doc["turns"]) == 4
        # The turn in flight when its worker died was finished by smg on
        # the survivor (its retry); the next one ran there too.
        if first[doc["session_id"]] == victim.url:
            assert doc["turns"][1]["worker"] == survivor.url
        assert doc["turns"][2]["worker"] == survivor.url
        # Each turn records the worker that was sent exactly its prompt.
        for turn in doc["turns"]:
            assert doc["token_ids"][: turn["completion_start"]] in prompts[turn["worker"]]


async def test_sglang_generate_behind_smg_is_refused_naming_the_parse_routes(
    nursery: trio.Nursery, text_model: TextModel, tmp_path: Path
) -> None:
    """smg answers /parse_function_call 404: `sglang-generate` would fail
    every answer with tool calls, so naming it is refused at start-up."""
    _require_smg()
    worker = await spawn_worker(nursery, text_model, EmulatorConfig())
    gateway = await start_smg(nursery, [worker.url], tmp_path / "smg.log")
    try:
        settings = Settings(workers=(gateway.url,), engine="sglang-generate")
        with pytest.raises(ValueError) as refused:
            await resolve_engine(
                settings, settings.workers, tls=TLS, deadline_s=10.0, connect_timeout_s=5.0
            )
        assert str(refused.value) == (
            "--engine sglang-generate needs workers with SGLang's parse routes "
            "(/separate_reasoning, /parse_function_call); they run with no parse routes "
            "(a gateway in front that does not route them, as smg)"
        )
    finally:
        await gateway.client.aclose()
