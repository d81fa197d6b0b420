"""Every failure path answers the documented error, commits nothing and
releases the session's slot so the next legal turn succeeds."""

from __future__ import annotations

import functools
import logging
from typing import Any

import httpx
import pytest
import trio

from rollout_session.emulator.worker import EmulatorConfig
from tests.conftest import Stack, StackFactory

USER = [{"role": "user", "content": "hello"}]


async def assert_released_and_clean(stack: Stack, session_id: str) -> None:
    """Nothing was committed, and a legal turn now succeeds."""
    session = stack.ctx.registry.get(session_id)
    assert session.slot is None
    assert session.trajectory.turns == [] and len(session.trajectory) == 0
    stack.emulator.faults.fault = None
    response = await stack.chat(session_id, messages=USER)
    assert response.status_code == 200, response.text


FAULT_CASES = [
    ("nan_logprob", 502, "upstream_malformed"),
    ("infinity_logprob", 502, "upstream_malformed"),
    ("positive_logprob", 502, "upstream_malformed"),
    ("bool_token_id", 502, "upstream_malformed"),
    ("str_token_id", 502, "upstream_malformed"),
    ("float_token_id", 502, "upstream_malformed"),
    ("out_of_vocab_id", 502, "upstream_malformed"),
    ("length_mismatch", 502, "upstream_malformed"),
    ("missing_meta_info", 502, "upstream_malformed"),
    ("prompt_tokens_mismatch", 502, "upstream_malformed"),
    ("malformed_json", 502, "upstream_malformed"),
    ("drop_connection", 502, "upstream_error"),
    ("stall", 504, "upstream_timeout"),
]


@pytest.mark.parametrize(("fault", "status", "code"), FAULT_CASES, ids=[c[0] for c in FAULT_CASES])
async def test_emulator_fault_is_reported_and_nothing_committed(
    make_stack: StackFactory, fault: str, status: int, code: str
) -> None:
    stack = await make_stack(emulator=EmulatorConfig(fault=fault), upstream_timeout_s=0.5)
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    await assert_released_and_clean(stack, session_id)


@pytest.mark.parametrize("fault", ["http_400", "http_500"], ids=["worker-400", "worker-500"])
async def test_worker_error_is_passed_through_unchanged(
    make_stack: StackFactory, fault: str
) -> None:
    stack = await make_stack(emulator=EmulatorConfig(fault=fault))
    session_id = await stack.create()
    direct = await stack.client.post(
        f"{stack.emulator_url}/v1/chat/completions", json={"messages": USER}
    )
    response = await stack.chat(session_id, messages=USER)
    assert response.status_code == direct.status_code
    assert response.content == direct.content  # SGLang's flat error, untouched
    assert response.json()["object"] == "error"
    await assert_released_and_clean(stack, session_id)


async def test_transport_error_is_502_and_releases(make_stack: StackFactory) -> None:
    stack = await make_stack()
    session_id = await stack.create()
    await stack.emulator_server.aclose()  # the worker is gone: connect refused
    response = await stack.chat(session_id, messages=USER)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"
    session = stack.ctx.registry.get(session_id)
    assert session.slot is None and session.trajectory.turns == []


async def test_client_disconnect_mid_turn_cancels_upstream_and_releases(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(emulator=EmulatorConfig(fault="stall"))
    session_id = await stack.create()
    session = stack.ctx.registry.get(session_id)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(stack.chat, session_id, messages=USER))
        await stack.emulator.wait_for_requests(1)
        slot = session.slot
        assert slot is not None
        nursery.cancel_scope.cancel()  # the agent goes away mid-turn
    await slot.done.wait()
    # The server's handler was cancelled and so was its upstream request.
    await stack.emulator.wait_for_cancelled(1)
    assert stack.emulator.completed == 0
    await assert_released_and_clean(stack, session_id)


async def test_invariant_violation_is_500_logged_with_session_id(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    session = stack.ctx.registry.get(session_id)
    # Corrupt the stored sequence behind the turn records' back.
    session.trajectory.tokens.truncate(len(session.trajectory) - 1)
    received = stack.emulator.received
    with caplog.at_level(logging.ERROR, logger="rollout_session"):
        response = await stack.chat(session_id, messages=[*USER, {"role": "user", "content": "x"}])
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "invariant_violated"
    assert any(session_id in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert stack.emulator.received == received  # the worker was never asked
    assert session.slot is None


async def test_malformed_request_is_400_and_never_reaches_worker(stack: Stack) -> None:
    session_id = await stack.create()
    response = await stack.client.post(
        f"/sessions/{session_id}/v1/chat/completions", content=b"{not json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert stack.emulator.received == 0
    await assert_released_and_clean(stack, session_id)


async def test_context_length_exceeded_before_any_worker(make_stack: StackFactory) -> None:
    stack = await make_stack(context_length=64)
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER, max_tokens=60)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert stack.emulator.received == 0


async def test_error_bodies_have_openai_shape(stack: Stack) -> None:
    responses: list[httpx.Response] = [
        await stack.client.get("/no/such/route"),
        await stack.client.put("/sessions"),
        await stack.client.get("/sessions/missing"),
    ]
    for response in responses:
        error: dict[str, Any] = response.json()["error"]
        assert set(error) == {"message", "type", "code", "param"}
        assert response.headers["content-type"] == "application/json"
    assert [r.status_code for r in responses] == [404, 405, 404]
