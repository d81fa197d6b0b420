"""What a worker's answer can do to the server, and what an agent learns of it.

- An answer over ``--max-answer-mb`` (here: one that never ends) is a 502
  ``upstream_malformed``: read no further, its memory released, its
  connection to the worker closed.
- Errors an agent gets never name a worker (its URL is logged instead).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import trio

from rollout_session.emulator import EmulatorConfig
from rollout_session.emulator.faults import FaultPicker
from tests.conftest import Stack, StackFactory

USER = [{"role": "user", "content": "hello"}]
MB = 1 << 20


def rss_bytes() -> int:
    """This process's resident set (server, emulator and test share it)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def turn(stack: Stack, session_id: str) -> Any:
    doc = await stack.trajectory(session_id)
    messages = [*doc["messages"], {"role": "user", "content": "next"}] if doc["turns"] else USER
    return await stack.chat(session_id, messages=messages)


async def test_an_endless_answer_is_refused_and_its_memory_released(
    make_stack: StackFactory,
) -> None:
    # A short upstream timeout only bounds a broken server's run of this
    # test; the circuit stays closed for the five failures in a row.
    stack = await make_stack(max_answer_mb=8, upstream_timeout_s=2, circuit_failures=10)
    emulator = stack.emulator
    session_id = await stack.create()
    assert (await turn(stack, session_id)).status_code == 200
    before = rss_bytes()
    emulator.faults = FaultPicker("endless_body", 1.0, 0)
    for i in range(1, 6):
        response = await turn(stack, session_id)
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert error["code"] == "upstream_malformed"
        assert "--max-answer-mb (8 MB)" in error["message"]
        # The server hung up: the worker's endless stream stopped.
        with trio.fail_after(10):
            await emulator.wait_until(lambda: emulator.endless_ended >= i)  # noqa: B023
    grown = rss_bytes() - before
    # Five answers cut at 8 MB: what is kept is at most a few of those
    # (allocator reuse), never the gigabytes an unbounded read reaches.
    assert grown < 64 * MB, f"RSS grew by {grown / MB:.0f} MB"
    # Nothing was committed; the worker serves the next turn on a new connection.
    emulator.faults = FaultPicker(None, 1.0, 0)
    assert (await turn(stack, session_id)).status_code == 200
    assert len((await stack.trajectory(session_id))["turns"]) == 2


async def test_a_declared_oversize_answer_is_not_read(make_stack: StackFactory) -> None:
    """A Content-Length over the limit is refused before the body is read."""
    stack = await make_stack(max_answer_mb=0.001)  # ~1 KB: any real answer is over it
    session_id = await stack.create()
    response = await turn(stack, session_id)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_malformed"


FAILURES: dict[str, tuple[dict[str, Any], int, str]] = {
    # fault → (settings, agent's status, code)
    "drop_connection": ({}, 502, "upstream_error"),
    "stall": ({"upstream_timeout_s": 0.5}, 504, "upstream_timeout"),
    "endless_body": ({"max_answer_mb": 1}, 502, "upstream_malformed"),
}


@pytest.mark.parametrize("fault", FAILURES, ids=FAILURES)
async def test_agents_errors_never_name_the_worker(
    make_stack: StackFactory, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings, status, code = FAILURES[fault]
    stack = await make_stack(emulator=EmulatorConfig(fault=fault), **settings)
    session_id = await stack.create()
    response = await turn(stack, session_id)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)
    host_port = stack.emulator_url.removeprefix("http://")
    assert host_port not in response.text
    # The operator still learns which worker failed.
    assert any(stack.emulator_url in record.getMessage() for record in caplog.records)


async def test_a_refused_connection_never_names_the_worker(make_stack: StackFactory) -> None:
    stack = await make_stack()
    session_id = await stack.create()
    stack.workers[0].kill()  # no probe noticed yet: the turn meets a refused connect
    response = await turn(stack, session_id)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"
    assert stack.emulator_url.removeprefix("http://") not in response.text
