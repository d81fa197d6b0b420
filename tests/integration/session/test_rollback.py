"""History matching, retries and --on-divergence rollback (docs/api.md#history-rules),
end to end. Segments, the default for other divergences, are test_segments.py's."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tests.conftest import OTHER_TOOLS, TOOLS, Stack, StackFactory
from tests.integration.session.test_turns import answered, check_document, run_tool_episode


@pytest.fixture
async def rollback_stack(make_stack: StackFactory) -> Stack:
    return await make_stack(on_divergence="rollback")


async def test_retry_of_last_turn_rolls_back_one_turn(stack: Stack) -> None:
    session_id = await stack.create()
    messages, _ = await run_tool_episode(stack, session_id, turns=2)
    before = await stack.trajectory(session_id)
    # The agent never saw the 2nd answer (e.g. it timed out) and retries it.
    retry = messages[:-1]
    response = await stack.chat(session_id, messages=retry, tools=TOOLS, seed=99)
    assert response.status_code == 200, response.text
    after = await stack.trajectory(session_id)
    check_document(after)
    assert len(after["turns"]) == 2
    kept = before["turns"][0]["completion_end"]
    assert after["token_ids"][:kept] == before["token_ids"][:kept]
    assert after["messages"][-1]["content"] == response.json()["choices"][0]["message"]["content"]
    # The retried turn's prompt is the same as the dropped one's.
    assert after["turns"][1]["completion_start"] == before["turns"][1]["completion_start"]


async def test_agent_that_edits_last_tool_result_rolls_back(rollback_stack: Stack) -> None:
    stack = rollback_stack
    session_id = await stack.create()
    messages, _ = await run_tool_episode(stack, session_id, turns=2)
    edited = [*messages[:-2], {**messages[-2], "content": "a different tool result"}]
    response = await stack.chat(session_id, messages=edited, tools=TOOLS)
    assert response.status_code == 200, response.text
    assert len((await stack.trajectory(session_id))["turns"]) == 2


async def test_divergence_deeper_than_limit_is_400_and_keeps_history(
    rollback_stack: Stack,
) -> None:
    stack = rollback_stack
    session_id = await stack.create()
    messages, _ = await run_tool_episode(stack, session_id, turns=3)
    before = await stack.trajectory(session_id)
    diverged = [messages[0], {"role": "user", "content": "something else entirely"}]
    response = await stack.chat(session_id, messages=diverged, tools=TOOLS)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "trajectory_diverged"
    assert await stack.trajectory(session_id) == before


async def test_changed_tools_diverge_from_the_first_prompt(rollback_stack: Stack) -> None:
    stack = rollback_stack
    session_id = await stack.create()
    messages, _ = await run_tool_episode(stack, session_id, turns=3)
    messages += answered(messages[-1])[1:]  # the last answer's calls, answered
    messages.append({"role": "user", "content": "next"})
    response = await stack.chat(session_id, messages=messages, tools=None)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "trajectory_diverged"


@pytest.mark.parametrize("policy", ["segment", "rollback", "error"])
async def test_first_turn_retry_is_always_allowed(make_stack: StackFactory, policy: str) -> None:
    stack = await make_stack(max_rollback_turns=0, on_divergence=policy)
    session_id = await stack.create()
    messages = [{"role": "user", "content": "first"}]
    first = await stack.chat(session_id, messages=messages, seed=1)
    retry = await stack.chat(session_id, messages=messages, seed=2)
    assert (first.status_code, retry.status_code) == (200, 200)
    doc = await stack.trajectory(session_id)
    check_document(doc)
    assert len(doc["turns"]) == 1
    sampled = [e[1] for e in retry.json()["choices"][0]["meta_info"]["output_token_logprobs"]]
    assert doc["token_ids"][doc["turns"][0]["completion_start"] :] == sampled


async def test_a_retry_is_allowed_even_where_no_rollback_is(make_stack: StackFactory) -> None:
    stack = await make_stack(max_rollback_turns=0, on_divergence="rollback")
    session_id = await stack.create()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "first"}]
    first = (await stack.chat(session_id, messages=messages)).json()
    messages += [*answered(first["choices"][0]["message"]), {"role": "user", "content": "second"}]
    assert (await stack.chat(session_id, messages=messages)).status_code == 200
    retry = await stack.chat(session_id, messages=messages)
    assert retry.status_code == 200, retry.text
    doc = await stack.trajectory(session_id, schema=3)
    assert [r["reason"] for r in doc["rollbacks"]] == ["retry"]
    # Anything else that would drop a turn is refused.
    edited = [*messages[:-1], {"role": "user", "content": "edited"}]
    response = await stack.chat(session_id, messages=edited)
    assert response.json()["error"]["code"] == "trajectory_diverged"


async def test_history_compare_ignores_ids_key_order_and_empty_forms(stack: Stack) -> None:
    session_id = await stack.create()
    messages, answers = await run_tool_episode(stack, session_id, turns=1)
    call = answers[0]["choices"][0]["message"]["tool_calls"][0]
    args = json.loads(call["function"]["arguments"])
    reordered = json.dumps(dict(reversed(list(args.items()))), indent=2)
    messages[-1] = {
        "role": "assistant",
        "content": None,  # the answer had "": equal
        "tool_calls": [
            {
                "id": "other-id",
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": reordered},
            }
        ],
    }
    messages.append({"role": "tool", "tool_call_id": "other-id", "content": "ok"})
    response = await stack.chat(session_id, messages=messages, tools=TOOLS)
    assert response.status_code == 200, response.text
    assert len((await stack.trajectory(session_id))["turns"]) == 2


USER_1 = {"role": "user", "content": "first question"}


def after_one_answer(answer: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each pattern's second request, after the first turn's `answer`."""
    return {
        # The agent never saw the answer and sends the same request again.
        "retry": [USER_1],
        # The SDK dropped an empty answer and asked again (answer_dropped).
        "answer_dropped": [USER_1, {"role": "user", "content": "please answer"}],
        # The agent rewrote its own question.
        "history_edited": [{"role": "user", "content": "another question"}],
        "tools_changed": [USER_1, *answered(answer), {"role": "user", "content": "go on"}],
    }


@pytest.mark.parametrize(
    ("reason", "at_message"),
    [("retry", 1), ("answer_dropped", 1), ("history_edited", 0), ("tools_changed", 0)],
    ids=["retry", "answer_dropped", "history_edited", "tools_changed"],
)
async def test_every_rollback_is_logged_and_counted_by_reason(
    rollback_stack: Stack, caplog: pytest.LogCaptureFixture, reason: str, at_message: int
) -> None:
    stack = rollback_stack
    session_id = await stack.create()
    first = await stack.chat(session_id, messages=[USER_1], tools=TOOLS)
    assert first.status_code == 200, first.text
    counter = stack.ctx.metrics.rollbacks.labels(reason)
    assert counter._value.get() == 0
    messages = after_one_answer(first.json()["choices"][0]["message"])[reason]
    tools = OTHER_TOOLS if reason == "tools_changed" else TOOLS
    with caplog.at_level(logging.INFO, logger="rollout_session"):
        second = await stack.chat(session_id, messages=messages, tools=tools)
    assert second.status_code == 200, second.text
    assert counter._value.get() == 1
    expected = (
        f"session {session_id}: rollback ({reason}): 1 turn(s) of segment 0 dropped; the "
        f"request differs from the stored history at message {at_message}"
    )
    assert expected in caplog.messages
    doc = await stack.trajectory(session_id, schema=3)
    assert doc["num_segments"] == 1
    assert [
        (r["reason"], r["turn"], r["dropped_turns"], r["message"]) for r in doc["rollbacks"]
    ] == [(reason, 0, 1, at_message)]


async def test_an_extension_is_no_rollback(stack: Stack) -> None:
    session_id = await stack.create()
    await run_tool_episode(stack, session_id, turns=3)
    for reason in ("retry", "answer_dropped", "history_edited", "tools_changed"):
        assert stack.ctx.metrics.rollbacks.labels(reason)._value.get() == 0
        assert stack.ctx.metrics.segments.labels(reason)._value.get() == 0
    doc = await stack.trajectory(session_id, schema=3)
    assert (doc["num_segments"], doc["rollbacks"]) == (1, [])
