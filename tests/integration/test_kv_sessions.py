"""Worker-side KV sessions (`--kv-sessions stream`, docs/kv-sessions.md).

The promise: a trajectory is the same token for token with and without
worker-side sessions; under `stream` a turn that extends the session sends
the worker only the ids it does not hold, and every case where the worker
may not hold exactly the trajectory's prefix rebuilds its session — once,
visibly, and the episode goes on exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from rollout_session.testing.emulator import EmulatorConfig

from ..conftest import TOOLS, Stack, StackFactory, spawn_worker
from .test_turns import check_document, echo

SYSTEM = {"role": "system", "content": "You are a coding agent."}
QUICK = {"health_interval_s": 0.05, "health_timeout_s": 0.5, "unhealthy_after": 1}


def _follow_up(message: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """What the agent appends after an answer: its tool results, or a user turn."""
    calls = message.get("tool_calls") or []
    if calls:
        return [
            {"role": "tool", "tool_call_id": call["id"], "content": f"result {step}"}
            for call in calls
        ]
    return [{"role": "user", "content": f"go on ({step})"}]


class Episode:
    """One agent on the raw HTTP route, its history as an OpenAI agent keeps it."""

    def __init__(self, stack: Stack, session_id: str) -> None:
        self.stack, self.session_id = stack, session_id
        self.messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "fix main.py"}]
        self.step = 0

    async def ask(self, **extra: Any) -> dict[str, Any]:
        response = await self.stack.chat(
            self.session_id, messages=self.messages, tools=TOOLS, seed=self.step, **extra
        )
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    async def turn(self, **extra: Any) -> dict[str, Any]:
        answer = await self.ask(**extra)
        message = answer["choices"][0]["message"]
        self.messages = [*self.messages, echo(message), *_follow_up(message, self.step)]
        self.step += 1
        return answer

    async def retry(self) -> None:
        """The previous request again, as after a lost answer."""
        self.step -= 1
        self.messages = self.messages[: self._last_request_end]
        await self.turn()

    async def turn_keeping_request(self) -> None:
        self._last_request_end = len(self.messages)
        await self.turn()

    def compact(self) -> None:
        self.messages = [SYSTEM, {"role": "user", "content": f"summary of {self.step} steps"}]


async def run_episode(stack: Stack) -> str:
    """Extensions, tool calls, a retry, a `length` junction and a compacted
    history (a new segment), each followed by more extensions."""
    session_id = await stack.create()
    agent = Episode(stack, session_id)
    for _ in range(3):
        await agent.turn()
    await agent.turn_keeping_request()
    await agent.retry()
    await agent.turn()
    await agent.turn(max_tokens=3)  # finish_reason=length: the junction rules apply
    await agent.turn()
    agent.compact()
    for _ in range(3):
        await agent.turn()
    return session_id


def _segments(doc: dict[str, Any]) -> list[Any]:
    return [
        (s["token_ids"], s["loss_mask"], s["logprobs"], [t["finish_reason"] for t in s["turns"]])
        for s in doc["segments"]
    ]


def _opened(stack: Stack) -> dict[str, float]:
    """rollout_kv_sessions_opened_total by cause."""
    metric = stack.ctx.metrics.kv_opened
    return {
        sample.labels["cause"]: sample.value
        for family in metric.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def _session_turns(stack: Stack) -> list[dict[str, Any]]:
    """The chat bodies the workers received, oldest first."""
    return [r.body for w in stack.workers for r in w.emulator.requests]


@pytest.mark.parametrize(
    "template,reasoning", [("chatml", False), ("qwen3", True)], ids=["chatml", "qwen3-reasoning"]
)
async def test_stream_trajectories_equal_off_and_send_only_new_ids(
    make_stack: StackFactory, template: str, reasoning: bool
) -> None:
    config = EmulatorConfig(reasoning=reasoning)
    off = await make_stack(template=template, emulator=config)
    stream = await make_stack(template=template, emulator=config, kv_sessions="stream")
    expected = await off.trajectory(await run_episode(off))
    session_id = await run_episode(stream)
    doc = await stream.trajectory(session_id)
    check_document(doc)
    assert doc["num_segments"] == 2 and len(doc["rollbacks"]) == 1
    assert _segments(doc) == _segments(expected)
    # One session for the first turn; the retry and the compaction left the
    # context the worker held: each rebuilt it once.
    assert _opened(stream) == {"new": 1.0, "branched": 2.0}
    # Each turn sent what the worker did not hold: a turn that extended its
    # segment only its prompt delta, every other its whole prompt.
    bodies = _session_turns(stream)
    turns = [t for s in doc["segments"] for t in s["turns"]]
    sent = [len(b["input_ids"]) for b in bodies]
    assert all(b["session_params"]["id"].startswith(session_id) for b in bodies)
    full = [t["completion_start"] for t in turns]
    delta = [t["completion_start"] - t["prompt_start"] for t in turns]
    # The retried turn's first answer was replaced: drop its request.
    retried = 4
    del sent[retried - 1]
    first_of_segment = {0, len(doc["segments"][0]["turns"])}
    rebuilt = first_of_segment | {retried - 1}
    assert sent == [full[i] if i in rebuilt else delta[i] for i in range(len(turns))]
    assert sum(sent) < sum(full) / 2


async def test_delete_and_expiry_close_the_worker_session(make_stack: StackFactory) -> None:
    stack = await make_stack(kv_sessions="stream")
    emulator = stack.emulator
    collected, expiring = await stack.create(), await stack.create(ttl_s=0.2)
    for session_id in (collected, expiring):
        agent = Episode(stack, session_id)
        await agent.turn()
        await agent.turn()
    held = {b["session_params"]["id"] for b in _session_turns(stack)}
    assert len(held) == 2 and held <= set(emulator.open_sessions)
    assert (await stack.client.delete(f"/sessions/{collected}")).status_code == 200
    with trio.fail_after(10):
        await emulator.wait_until(lambda: not set(emulator.open_sessions) & held)
    assert set(emulator.sessions_closed) >= held


async def test_a_worker_that_lost_the_session_is_rebuilt_once(make_stack: StackFactory) -> None:
    stack = await make_stack(kv_sessions="stream")
    session_id = await stack.create()
    agent = Episode(stack, session_id)
    await agent.turn()
    await agent.turn()
    # The worker forgets it (a restart, its timeout): the next turn is told
    # so, and the agent does not notice.
    (remote,) = stack.emulator.open_sessions
    stack.emulator.close_session(remote)
    await agent.turn()
    await agent.turn()
    assert _opened(stack) == {"new": 1.0, "lost": 1.0}
    off = await make_stack()
    expected = await off.trajectory(await _three_turns_then_one(off))
    assert _segments(await stack.trajectory(session_id)) == _segments(expected)


async def _three_turns_then_one(stack: Stack) -> str:
    session_id = await stack.create()
    agent = Episode(stack, session_id)
    for _ in range(4):
        await agent.turn()
    return session_id


async def test_a_restarted_worker_rebuilds_and_the_episode_goes_on(
    make_stack: StackFactory, nursery: trio.Nursery
) -> None:
    stack = await make_stack(kv_sessions="stream", **QUICK)
    session_id = await stack.create()
    agent = Episode(stack, session_id)
    await agent.turn()
    await agent.turn()
    worker = stack.workers[0]
    worker.kill()
    restarted = await spawn_worker(
        nursery, worker.emulator.model, worker.emulator.config, worker.port
    )
    stack.workers[0] = restarted
    await agent.turn()
    await agent.turn()
    assert _opened(stack) == {"new": 1.0, "lost": 1.0}
    assert len(restarted.emulator.open_sessions) == 1
    off = await make_stack()
    expected = await off.trajectory(await _three_turns_then_one(off))
    assert _segments(await stack.trajectory(session_id)) == _segments(expected)


async def test_a_failover_re_pin_rebuilds_on_the_new_worker(make_stack: StackFactory) -> None:
    stack = await make_stack(kv_sessions="stream", num_workers=2, **QUICK)
    session_id = await stack.create()
    agent = Episode(stack, session_id)
    await agent.turn()
    await agent.turn()
    pinned = stack.ctx.registry.get(session_id).worker
    old = next(w for w in stack.workers if w.url == pinned)
    new = next(w for w in stack.workers if w is not old)
    old.kill()
    with trio.fail_after(10):
        await stack.ctx.pool.wait_for_health(old.url, False)
    await agent.turn()
    await agent.turn()
    assert _opened(stack) == {"new": 1.0, "moved": 1.0}
    doc = await stack.trajectory(session_id)
    assert [t["worker"] for t in doc["turns"]] == [old.url] * 2 + [new.url] * 2
    assert len(new.emulator.open_sessions) == 1


async def test_a_worker_session_timeout_rebuilds(make_stack: StackFactory) -> None:
    stack = await make_stack(kv_sessions="stream", kv_session_timeout_s=0.05)
    session_id = await stack.create()
    agent = Episode(stack, session_id)
    await agent.turn()
    emulator = stack.emulator
    with trio.fail_after(10):
        await emulator.wait_until(lambda: not emulator.open_sessions)
    await agent.turn()
    assert _opened(stack) == {"new": 1.0, "lost": 1.0}


async def test_an_uncommitted_turn_rebuilds_the_next(make_stack: StackFactory) -> None:
    stack = await make_stack(kv_sessions="stream")
    session_id = await stack.create()
    agent = Episode(stack, session_id)
    await agent.turn()
    # The worker answers the next turn with garbage: 502, nothing committed,
    # and what its session holds now is unknown.
    stack.emulator.faults.fault = "nan_logprob"
    response = await stack.chat(session_id, messages=agent.messages, tools=TOOLS, seed=agent.step)
    assert response.status_code == 502, response.text
    stack.emulator.faults.fault = None
    await agent.turn()
    assert _opened(stack) == {"new": 1.0, "unsettled": 1.0}


async def test_priority_reaches_the_worker(make_stack: StackFactory) -> None:
    stack = await make_stack(default_priority=5)
    first = await stack.create()
    second = await stack.create(priority=-3)
    for session_id in (first, second):
        await Episode(stack, session_id).turn()
    assert [b["priority"] for b in _session_turns(stack)] == [5, -3]
    bad = await stack.client.post("/sessions", json={"priority": 1 << 63})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
