"""Delta-sync (`--kv-sessions delta`, engine sglang-generate): each turn sends
only the ids the worker does not hold over SGLang's sessions, the
trajectory stays identical to `off`, and a worker session that is lost,
left behind or branched from is rebuilt with the whole prompt — counted,
never a failed turn (docs/kv-sessions.md)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from rollout_session import Settings
from rollout_session.emulator.sglang.sessions import SessionTable
from rollout_session.engines.pool import Health
from rollout_session.engines.sglang_generate.delta import RemoteSessions
from rollout_session.engines.sglang_generate.engine import SGLangGenerateEngine
from tests.conftest import Stack, StackFactory

GENERATE = {"engine": "sglang-generate"}


def delta_of(stack: Stack) -> RemoteSessions:
    engine = stack.ctx.engine
    assert isinstance(engine, SGLangGenerateEngine) and engine.delta is not None
    return engine.delta


def generates(stack: Stack) -> list[dict[str, Any]]:
    return [r.body for w in stack.workers for r in w.emulator.requests if r.route == "generate"]


async def episode(stack: Stack, session_id: str, turns: int, start: int = 0) -> list[Any]:
    """`turns` user turns, each answer appended as the agent would."""
    messages: list[Any] = [{"role": "system", "content": "Be brief."}]
    for i in range(start, start + turns):
        messages.append({"role": "user", "content": f"Question {i}?"})
        response = await stack.chat(session_id, messages=messages, seed=i, max_tokens=24)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        messages.append({"role": "assistant", "content": message["content"]})
    return messages


async def test_each_turn_sends_only_new_ids_and_the_trajectory_is_the_same(
    make_stack: StackFactory,
) -> None:
    off = await make_stack(**GENERATE)
    delta = await make_stack(**GENERATE, kv_sessions="delta")
    a, b = await off.create(), await delta.create()
    await episode(off, a, 4)
    await episode(delta, b, 4)
    left, right = await off.trajectory(a), await delta.trajectory(b)
    for key in ("token_ids", "logprobs", "loss_mask"):
        assert left[key] == right[key], key
    sent = generates(delta)
    assert [("session_params" in body) for body in sent] == [True] * 4
    full = [len(body["input_ids"]) for body in generates(off)]
    short = [len(body["input_ids"]) for body in sent]
    # The first turn primes the session with the whole prompt; later turns
    # send what the trajectory appended after the worker's context.
    assert short[0] == full[0] and all(s < f for s, f in zip(short[1:], full[1:], strict=True))
    turns = right["turns"]
    for k in range(1, 4):
        assert short[k] == turns[k]["completion_start"] - turns[k - 1]["completion_end"]
    assert sent[1]["session_params"]["rid"] == sent[0]["rid"]
    assert delta_of(delta).rebuilds == {"first": 1} and delta_of(delta).delta_turns == 3


async def test_a_worker_that_lost_the_session_gets_it_rebuilt(make_stack: StackFactory) -> None:
    stack = await make_stack(**GENERATE, kv_sessions="delta")
    session_id = await stack.create()
    messages = await episode(stack, session_id, 2)
    # A restart: the worker's session controller is gone.
    stack.emulator.sessions = SessionTable(stack.emulator.model.tokenizer.bos_token_id)
    messages.append({"role": "user", "content": "And now?"})
    response = await stack.chat(session_id, messages=messages, seed=9, max_tokens=24)
    assert response.status_code == 200, response.text
    sent = generates(stack)
    assert len(sent) == 4  # the refused delta, then the whole prompt in a new session
    assert sent[3]["session_params"]["id"] != sent[2]["session_params"]["id"]
    assert "rid" not in sent[3]["session_params"]
    doc = await stack.trajectory(session_id)
    assert len(sent[3]["input_ids"]) == doc["turns"][2]["completion_start"]
    assert delta_of(stack).rebuilds["lost"] == 1


async def test_a_branch_before_the_workers_context_rebuilds(make_stack: StackFactory) -> None:
    stack = await make_stack(**GENERATE, kv_sessions="delta", on_divergence="segment")
    session_id = await stack.create()
    await episode(stack, session_id, 2)
    # A new conversation in the same session: a new segment, which the
    # worker's context does not prefix.
    await episode(stack, session_id, 1, start=5)
    assert delta_of(stack).rebuilds["branched"] == 1
    sent = generates(stack)
    assert sent[2]["session_params"]["id"] != sent[1]["session_params"]["id"]
    closed = stack.emulator.sessions_closed
    with trio.fail_after(10):
        await stack.emulator.wait_until(lambda: sent[0]["session_params"]["id"] in closed)


async def test_a_session_that_moves_is_rebuilt_on_its_new_worker(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(**GENERATE, kv_sessions="delta", num_workers=2)
    session_id = await stack.create()
    messages = await episode(stack, session_id, 1)
    pinned = stack.ctx.registry.get(session_id).worker
    old = next(w for w in stack.workers if w.url == pinned)
    new = next(w for w in stack.workers if w is not old)
    [remote] = {r.body["session_params"]["id"] for r in old.emulator.requests}
    # The health checker gave up on the old worker, which still runs and
    # still holds the worker session.
    stack.ctx.pool.workers[old.url].health = Health.UNHEALTHY
    messages.append({"role": "user", "content": "Still there?"})
    response = await stack.chat(session_id, messages=messages, seed=3, max_tokens=24)
    assert response.status_code == 200, response.text
    assert delta_of(stack).rebuilds["moved"] == 1
    [moved] = [r.body for r in new.emulator.requests if r.route == "generate"]
    assert "rid" not in moved["session_params"] and moved["session_params"]["id"] != remote
    with trio.fail_after(10):
        await old.emulator.wait_until(lambda: remote in old.emulator.sessions_closed)


async def test_delete_and_shutdown_close_the_worker_sessions(make_stack: StackFactory) -> None:
    stack = await make_stack(**GENERATE, kv_sessions="delta")
    kept, deleted = await stack.create(), await stack.create()
    await episode(stack, kept, 1)
    await episode(stack, deleted, 1)
    remote = {b["session_params"]["id"] for b in generates(stack)}
    assert (await stack.client.delete(f"/sessions/{deleted}")).status_code == 200
    closed = stack.emulator.sessions_closed
    with trio.fail_after(10):
        await stack.emulator.wait_until(lambda: len(closed) == 1)
    assert len(delta_of(stack)) == 1
    await stack.server.aclose()
    assert set(closed) == remote and len(stack.emulator.sessions) == 0


def test_delta_needs_the_generate_engine() -> None:
    with pytest.raises(ValueError, match="needs --engine sglang-generate"):
        Settings(workers=("http://w",), kv_sessions="delta", engine="sglang-chat")
    Settings(workers=("http://w",), kv_sessions="delta", engine="sglang-generate")


async def test_primes_and_delta_turns_are_metrics(make_stack: StackFactory) -> None:
    stack = await make_stack(**GENERATE, kv_sessions="delta")
    session_id = await stack.create()
    await episode(stack, session_id, 3)
    text = (await stack.client.get("/metrics")).text
    assert 'rollout_kv_session_primes_total{cause="first"} 1.0' in text
    assert "rollout_kv_delta_turns_total 2.0" in text


async def test_a_retried_turn_rolls_back_and_stays_exact(make_stack: StackFactory) -> None:
    docs = []
    for kv_sessions in ("off", "delta"):
        stack = await make_stack(**GENERATE, kv_sessions=kv_sessions, on_divergence="rollback")
        session_id = await stack.create()
        messages = await episode(stack, session_id, 2)
        # The agent retries its last request: the last turn is rolled back
        # and sampled again, from a prompt the worker's context extends past.
        response = await stack.chat(session_id, messages=messages[:-1], seed=7, max_tokens=24)
        assert response.status_code == 200, response.text
        docs.append(await stack.trajectory(session_id))
    off, delta = docs
    for key in ("token_ids", "logprobs", "loss_mask"):
        assert delta[key] == off[key], key
    assert delta_of(stack).rebuilds["branched"] == 1


async def test_a_session_the_workers_reaper_closed_is_rebuilt(make_stack: StackFactory) -> None:
    stack = await make_stack(**GENERATE, kv_sessions="delta", session_ttl_s=600.0)
    session_id = await stack.create()
    messages = await episode(stack, session_id, 1)
    opened = generates(stack)[0]["session_params"]["id"]
    # The worker session was opened with timeout = --session-ttl-s; idle past
    # it on the worker's clock, the worker's reaper closes it (the server's
    # clock, and so its own session, did not move).
    stack.emulator.advance_clock(601.0)
    messages.append({"role": "user", "content": "Later?"})
    response = await stack.chat(session_id, messages=messages, seed=4, max_tokens=24)
    assert response.status_code == 200, response.text
    assert opened not in stack.emulator.sessions
    assert delta_of(stack).rebuilds["lost"] == 1


async def test_an_expired_session_closes_its_worker_session(make_stack: StackFactory) -> None:
    stack = await make_stack(**GENERATE, kv_sessions="delta")
    session_id = await stack.create()
    await episode(stack, session_id, 1)
    [remote] = {b["session_params"]["id"] for b in generates(stack)}
    stack.ctx.store.expire(stack.ctx.registry.get(session_id))  # what the reaper does
    with trio.fail_after(10):
        await stack.emulator.wait_until(lambda: remote in stack.emulator.sessions_closed)
    assert len(delta_of(stack)) == 0
