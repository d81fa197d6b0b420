"""Fault matrix and crash durability.

Every scenario replays one scripted conversation with a fault at one turn.
The agent must get the documented status, the slot must be free, and the
committed trajectory must be byte-identical to the fault-free run's
committed prefix; after retrying, the whole run must equal the fault-free one.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig, TextModel, bundled_tokenizer_path
from rollout_session.http.app import server_context
from rollout_session.http.serving import start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import TOOLS, Stack, StackFactory, spawn_worker
from tests.integration.session.test_turns import check_document
from tests.loopback import TLS
from tests.processes import start_listening

TURNS = 4
FAULT_AT = 2


def request_for(turn: int, answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The agent's request for `turn`, given the answers it saw so far."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Inspect the project."}]
    for i, answer in enumerate(answers[:turn]):
        message = answer["choices"][0]["message"]
        messages.append({k: message.get(k) for k in ("role", "content", "tool_calls")})
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"r{i}"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": f"next {i}"})
    return {"messages": messages, "tools": TOOLS, "seed": turn}


# The document as v1 had it: the (one) segment's fields at the top level.
V1 = {"schema": 1}


def committed(doc: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
    return (
        np.asarray(doc["token_ids"], np.int32).tobytes(),
        np.asarray(doc["loss_mask"], np.uint8).tobytes(),
        np.asarray(doc["logprobs"], np.float32).tobytes(),
    )


def prefix(doc: dict[str, Any], turns: int) -> tuple[bytes, bytes, bytes]:
    end = doc["turns"][turns - 1]["completion_end"] if turns else 0
    return committed({k: doc[k][:end] for k in ("token_ids", "loss_mask", "logprobs")})


async def scripted(
    url: Callable[[], str], session_id: str, turns: range, answers: list[dict[str, Any]]
) -> None:
    async with httpx.AsyncClient(timeout=30, verify=TLS) as client:
        for turn in turns:
            response = await client.post(
                f"{url()}/sessions/{session_id}/v1/chat/completions",
                json=request_for(turn, answers),
            )
            assert response.status_code == 200, response.text
            answers.append(response.json())


async def reference(make_stack: StackFactory) -> dict[str, Any]:
    stack = await make_stack(emulator=EmulatorConfig())
    session_id = await stack.create(session_id="episode")
    await scripted(lambda: stack.url, session_id, range(TURNS), [])
    return await stack.trajectory(session_id)


async def emulator_fault(stack: Stack, name: str) -> None:
    stack.emulator.faults.fault = name


async def kill_pinned_worker(stack: Stack, name: str) -> None:
    pinned = stack.ctx.registry.get("episode").worker
    next(w for w in stack.workers if w.url == pinned).kill()


SCENARIOS: list[tuple[str, str, int, str | None]] = [
    ("nan_logprob", "emulator", 502, "upstream_malformed"),
    ("malformed_json", "emulator", 502, "upstream_malformed"),
    ("length_mismatch", "emulator", 502, "upstream_malformed"),
    ("bool_token_id", "emulator", 502, "upstream_malformed"),
    ("out_of_vocab_id", "emulator", 502, "upstream_malformed"),
    ("drop_connection", "emulator", 502, "upstream_error"),
    ("stall", "emulator", 504, "upstream_timeout"),
    ("http_500", "emulator", 500, None),
    ("http_400", "emulator", 400, None),
    ("worker_kill", "kill", 200, None),
]


@pytest.mark.parametrize(
    ("fault", "kind", "status", "code"), SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
async def test_fault_matrix(
    make_stack: StackFactory, fault: str, kind: str, status: int, code: str | None
) -> None:
    expected = await reference(make_stack)
    stack = await make_stack(emulator=EmulatorConfig(), num_workers=2, upstream_timeout_s=0.5)
    session_id = await stack.create(session_id="episode")
    answers: list[dict[str, Any]] = []
    await scripted(lambda: stack.url, session_id, range(FAULT_AT), answers)
    inject: Callable[[Stack, str], Awaitable[None]] = (
        emulator_fault if kind == "emulator" else kill_pinned_worker
    )
    await inject(stack, fault)
    response = await stack.chat(session_id, **request_for(FAULT_AT, answers))
    assert response.status_code == status, response.text
    if code is not None:
        assert response.json()["error"]["code"] == code
    assert stack.ctx.registry.get(session_id).slot is None
    done = FAULT_AT + (status == 200)
    if status == 200:
        answers.append(response.json())
    assert prefix(await stack.trajectory(session_id), done) == prefix(expected, done)
    for worker in stack.workers:
        worker.emulator.faults.fault = None
    await scripted(lambda: stack.url, session_id, range(done, TURNS), answers)
    final = await stack.trajectory(session_id)
    check_document(final)
    assert committed(final) == committed(expected)


async def test_client_disconnect_in_the_matrix(make_stack: StackFactory) -> None:
    expected = await reference(make_stack)
    stack = await make_stack(emulator=EmulatorConfig())
    session_id = await stack.create(session_id="episode")
    answers: list[dict[str, Any]] = []
    await scripted(lambda: stack.url, session_id, range(FAULT_AT), answers)
    stack.emulator.faults.fault = "stall"
    slot_holder = stack.ctx.registry.get(session_id)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(stack.chat, session_id, **request_for(FAULT_AT, answers))
        )
        await stack.emulator.wait_for_requests(FAULT_AT + 1)
        slot = slot_holder.slot
        assert slot is not None
        nursery.cancel_scope.cancel()
    await slot.done.wait()
    assert slot_holder.slot is None
    assert prefix(await stack.trajectory(session_id), FAULT_AT) == prefix(expected, FAULT_AT)
    stack.emulator.faults.fault = None
    await scripted(lambda: stack.url, session_id, range(FAULT_AT, TURNS), answers)
    assert committed(await stack.trajectory(session_id)) == committed(expected)


async def test_server_restart_with_journal_continues(
    make_stack: StackFactory,
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    tmp_path: Path,
) -> None:
    expected = await reference(make_stack)
    worker = await spawn_worker(nursery, text_model, EmulatorConfig())
    settings = Settings(
        workers=(worker.url,),
        journal=str(tmp_path),
        journal_fsync="always",
        engine="sglang-chat",  # as the reference's stack
    )
    servers = []

    async def boot() -> str:
        app = create_app(settings, tokenizer=chat_tokenizers["chatml"], worker_tls=TLS)
        servers.append((await start_server(nursery, app), server_context(app)))
        return servers[-1][0].url

    url = await boot()
    async with httpx.AsyncClient(timeout=30, verify=TLS) as client:
        assert (await client.post(f"{url}/sessions", json={"session_id": "episode"})).is_success
    answers: list[dict[str, Any]] = []
    await scripted(lambda: url, "episode", range(FAULT_AT), answers)
    before = servers[-1][1].registry.get("episode")
    await servers[-1][0].aclose()  # the server goes away (graceful: journal flushed)
    url = await boot()
    restored = servers[-1][1].registry.get("episode")
    assert restored is not before
    async with httpx.AsyncClient(timeout=30, verify=TLS) as client:
        doc = (await client.get(f"{url}/sessions/episode/trajectory", params=V1)).json()
    assert prefix(doc, FAULT_AT) == prefix(expected, FAULT_AT)
    await scripted(lambda: url, "episode", range(FAULT_AT, TURNS), answers)
    async with httpx.AsyncClient(timeout=30, verify=TLS) as client:
        final = (await client.get(f"{url}/sessions/episode/trajectory", params=V1)).json()
    assert committed(final) == committed(expected)
    await servers[-1][0].aclose()


async def serve_process(
    nursery: trio.Nursery, worker: str, journal: Path
) -> tuple[str, trio.Process]:
    command = [
        sys.executable,
        "-m",
        "rollout_session",
        "serve",
        "--port",
        "0",
        "--worker",
        worker,
        "--tokenizer",
        str(bundled_tokenizer_path()),
        "--journal",
        str(journal),
        "--journal-fsync",
        "never",
        "--log-level",
        "warning",
    ]
    return await start_listening(nursery, command, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def test_kill_9_mid_run_loses_no_committed_turn(
    nursery: trio.Nursery, text_model: TextModel, tmp_path: Path
) -> None:
    worker = await spawn_worker(nursery, text_model, EmulatorConfig(base_latency_s=0.05))
    url, process = await serve_process(nursery, worker.url, tmp_path)
    acknowledged: dict[str, list[dict[str, Any]]] = {f"agent-{i}": [] for i in range(4)}
    async with httpx.AsyncClient(timeout=30, verify=TLS) as client:
        for session_id in acknowledged:
            await client.post(f"{url}/sessions", json={"session_id": session_id})

    async def agent(session_id: str) -> None:
        # Runs until the server dies under it; every 200 it saw must survive.
        try:
            await scripted(lambda: url, session_id, range(100), acknowledged[session_id])
        except (httpx.TransportError, AssertionError):
            return

    async with trio.open_nursery() as agents:
        for session_id in acknowledged:
            agents.start_soon(agent, session_id)
        await worker.emulator.wait_for_requests(10)
        process.send_signal(signal.SIGKILL)
    await process.wait()
    url, process = await serve_process(nursery, worker.url, tmp_path)
    async with httpx.AsyncClient(timeout=30, verify=TLS) as client:
        for session_id, answers in acknowledged.items():
            doc = (await client.get(f"{url}/sessions/{session_id}/trajectory", params=V1)).json()
            check_document(doc)
            # Every answered turn is there (a turn the agent never heard of may be too).
            assert len(doc["turns"]) >= len(answers)
            for turn, answer in zip(doc["turns"], answers, strict=False):
                ids = [e[1] for e in answer["choices"][0]["meta_info"]["output_token_logprobs"]]
                assert doc["token_ids"][turn["completion_start"] : turn["completion_end"]] == ids
    # Agents continue where their last acknowledged turn left them.
    for session_id, answers in acknowledged.items():
        await scripted(lambda: url, session_id, range(len(answers), len(answers) + 1), answers)
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        await process.wait()


async def test_sigterm_lets_the_inflight_turn_finish(
    nursery: trio.Nursery, text_model: TextModel, tmp_path: Path
) -> None:
    worker = await spawn_worker(nursery, text_model, EmulatorConfig(base_latency_s=1.0))
    url, process = await serve_process(nursery, worker.url, tmp_path)
    async with httpx.AsyncClient(base_url=url, timeout=30, verify=TLS) as client:
        session_id = (await client.post("/sessions")).json()["session_id"]
        results: list[httpx.Response] = []

        async def turn() -> None:
            results.append(
                await client.post(
                    f"/sessions/{session_id}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "slow"}]},
                )
            )

        async with trio.open_nursery() as inner:
            inner.start_soon(turn)
            await worker.emulator.wait_for_requests(1)
            process.send_signal(signal.SIGTERM)
        assert results[0].status_code == 200  # finished within --shutdown-grace-s
    with trio.fail_after(30):
        assert await process.wait() == 0
    # The turn was journaled before it was answered.
    url, process = await serve_process(nursery, worker.url, tmp_path)
    async with httpx.AsyncClient(base_url=url, timeout=30, verify=TLS) as client:
        doc = (await client.get(f"/sessions/{session_id}/trajectory", params=V1)).json()
    assert len(doc["turns"]) == 1
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        await process.wait()
