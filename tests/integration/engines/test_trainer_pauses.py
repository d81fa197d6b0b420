"""The trainer pauses its workers itself, under load
(docs/reliability.md#workers-the-trainer-pauses).

verl and SkyRL pause their inference servers for a weight update without
telling this server: vLLM's ``/pause`` (modes ``abort``, ``wait``,
``keep``; ``/is_paused`` only under ``VLLM_SERVER_DEV_MODE``, which verl's
in-process pause does not need), SGLang's ``/pause_generation`` (``abort``,
``retract``, ``in_place``). Every agent's turn must end with the answer,
whatever it met: an ``abort`` is continued once the worker generates again,
a refusal because the worker is paused (vLLM's 503) is waited out and sent
again, and neither is a failure: no circuit opens, no agent sees a 503.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
import trio

from rollout_session.engines.pool import Circuit
from tests.conftest import Stack, StackFactory
from tests.integration.engines.test_weight_updates import (
    ENGINES,
    THINK,
    make,
)
from tests.stalls import in_flight_midway, until

AGENTS = 12
TURNS = 2  # a second turn arrives while the worker may still be paused


@dataclass(frozen=True)
class Case:
    engine: str
    mode: str
    # How the trainer pauses: over HTTP (vLLM's dev mode, SGLang), or in
    # its own process (verl's vLLM: no /is_paused to read).
    over_http: bool = True


CASES = {
    "vllm-abort": Case("vllm", "abort"),
    "vllm-wait": Case("vllm", "wait"),
    "vllm-keep": Case("vllm", "keep"),
    "vllm-abort-in-process": Case("vllm", "abort", over_http=False),
    "sglang-generate-abort": Case("sglang-generate", "abort"),
    "sglang-generate-retract": Case("sglang-generate", "retract"),
    "sglang-generate-in_place": Case("sglang-generate", "in_place"),
    "sglang-chat-abort": Case("sglang-chat", "abort"),
}


async def _agents(stack: Stack, answers: list[httpx.Response]) -> None:
    async def agent(i: int) -> None:
        sid = await stack.create()
        messages: list[dict[str, Any]] = list(THINK)
        for _ in range(TURNS):
            answer = await stack.chat(sid, messages=messages, seed=i)
            answers.append(answer)
            if answer.status_code != 200:
                return
            messages += [
                answer.json()["choices"][0]["message"],
                {"role": "user", "content": "More."},
            ]

    async with trio.open_nursery() as nursery:
        for i in range(AGENTS):
            nursery.start_soon(agent, i)


def _pause_calls(
    stack: Stack, case: Case
) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    """The trainer's pause and resume (with its new weights' label)."""
    emulator = stack.emulator
    weights = emulator.weights
    url = stack.workers[0].url

    async def post(path: str, **kwargs: Any) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            answer = await client.post(path, **kwargs)
            assert answer.status_code == 200, answer.text

    if case.engine == "vllm":
        if case.over_http:
            return (
                lambda: post("/pause", params={"mode": case.mode}),
                lambda: _then(
                    post("/update_weight_version", json={"new_version": "v2"}), post("/resume")
                ),
            )

        async def pause() -> None:
            await weights.vllm_pause(case.mode, clear_cache=True)

        async def resume() -> None:
            weights.vllm_update_weight_version("v2")
            weights.vllm_resume()

        return pause, resume
    return (
        lambda: post("/pause_generation", json={"mode": case.mode}),
        lambda: _then(
            post("/update_weight_version", json={"new_version": "v2", "abort_all_requests": False}),
            post("/continue_generation", json={}),
        ),
    )


async def _then(*calls: Awaitable[None]) -> None:
    for call in calls:
        await call


def _waited_at_the_worker(stack: Stack, case: Case) -> bool:
    """A request met the pause: refused (vLLM abort/wait), or held at the
    worker's gate (SGLang, vLLM keep's frozen engine)."""
    weights = stack.emulator.weights
    if case.engine == "vllm" and case.mode != "keep":
        return weights.rejected > 0
    return weights.held > 0 or (weights.gpu.frozen and len(weights.running()) > 0)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_turns_go_on_when_the_trainer_pauses_the_workers(
    make_stack: StackFactory, case: Case
) -> None:
    engine = ENGINES[case.engine]
    if case.engine == "vllm":  # its RL routes (/pause, /is_paused) are dev mode's
        engine = replace(engine, emulator=replace(engine.emulator, dev_mode=case.over_http))
    stack = await make(
        make_stack,
        engine,
        completion_tokens=60,
        circuit_failures=1,  # one failure would open it: none may count
        pause_wait_s=60,
    )
    pause, resume = _pause_calls(stack, case)
    answers: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_agents, stack, answers)
        await until(lambda: in_flight_midway(stack.emulator, 10))
        await pause()
        await until(lambda: _waited_at_the_worker(stack, case))
        await resume()
    assert len(answers) == AGENTS * TURNS
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] != "abort"
    worker = stack.ctx.pool.get(stack.workers[0].url)
    assert worker.circuit is Circuit.CLOSED and worker.circuit_failures == 0
    metrics = (await stack.client.get("/metrics")).text
    refused = case.engine == "vllm" and case.mode != "keep"
    assert (worker.paused_refusals > 0) is refused
    counted = f'rollout_worker_paused_refusals_total{{worker="{worker.url}"}} '
    assert f"{counted}{float(worker.paused_refusals)}" in metrics
