"""End to end: the turn path against a real emulator over real sockets."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

from rollout_session.emulator import builtin_template
from rollout_session.emulator.worker import EmulatorConfig
from rollout_session.session.session import SessionState
from tests.conftest import TOOLS, Stack, StackFactory


def echo(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as an OpenAI SDK agent appends it to its history."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def answered(message: dict[str, Any], result: str = "ok") -> list[dict[str, Any]]:
    """`echo(message)` and a tool result for each of its calls: what an agent
    appends before its next user message (no call may be left unanswered)."""
    calls = message.get("tool_calls") or []
    return [
        echo(message),
        *({"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls),
    ]


def sampled(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    entries = answer["choices"][0]["meta_info"]["output_token_logprobs"]
    return [e[1] for e in entries], [e[0] for e in entries]


def check_document(doc: dict[str, Any]) -> None:
    """Schema rules of docs/training.md (the export document) that hold for
    every segment, and so for v1's document (``?schema=1``, the last segment)."""
    n = len(doc["token_ids"])
    assert n == len(doc["loss_mask"]) == len(doc["logprobs"])
    position = 0
    mask = np.zeros(n, np.uint8)
    for i, turn in enumerate(doc["turns"]):
        assert turn["index"] == i
        assert (
            position == turn["prompt_start"] <= turn["completion_start"] <= turn["completion_end"]
        )
        mask[turn["completion_start"] : turn["completion_end"]] = 1
        position = turn["completion_end"]
    assert position == n
    assert doc["loss_mask"] == mask.tolist()
    assert all(lp == 0.0 for lp, m in zip(doc["logprobs"], doc["loss_mask"], strict=True) if not m)
    if doc["turns"]:
        assert doc["prompt_length"] == doc["turns"][0]["completion_start"]


async def run_tool_episode(
    stack: Stack, session_id: str, turns: int
) -> tuple[list[Any], list[Any]]:
    """An agent loop: user → tool call → tool result → … ; returns (messages, answers)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "What does main.py print?"},
    ]
    answers = []
    for i in range(turns):
        response = await stack.chat(session_id, messages=messages, tools=TOOLS, seed=i)
        assert response.status_code == 200, response.text
        answer = response.json()
        answers.append(answer)
        message = answer["choices"][0]["message"]
        messages.append(echo(message))
        if i == turns - 1:
            break
        if message.get("tool_calls"):
            for call in message["tool_calls"]:
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": f"print({i})"}
                )
        else:
            messages.append({"role": "user", "content": f"Now look at file {i}."})
    return messages, answers


async def test_tool_conversation_equals_template_rendering(stack: Stack, hf_tokenizer: Any) -> None:
    session_id = await stack.create(metadata={"task": "demo"})
    messages, answers = await run_tool_episode(stack, session_id, turns=5)
    assert any(a["choices"][0]["message"].get("tool_calls") for a in answers)
    doc = await stack.trajectory(session_id)
    check_document(doc)
    assert doc["status"] == "open" and doc["metadata"] == {"task": "demo"}
    assert len(doc["turns"]) == 5

    # Invariant (docs/api.md#history-rules): the committed ids are the template's rendering of
    # the whole conversation, each assistant turn being its sampled ids. The
    # emulator samples canonical tokenizations, so plain tokenisation of the
    # rendering must reproduce them exactly.
    rendered = hf_tokenizer.apply_chat_template(
        messages, tools=TOOLS, chat_template=builtin_template("chatml"), tokenize=False
    )
    expected = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    ids = doc["token_ids"]
    # The last answer ends with the sampled <|im_end|>; the template's "\n"
    # after it is only added when the next turn comes.
    assert ids == expected[: len(ids)]
    assert hf_tokenizer.convert_ids_to_tokens(expected[len(ids) :]) == ["Ċ"]

    for turn, answer in zip(doc["turns"], answers, strict=True):
        sampled_ids, sampled_logprobs = sampled(answer)
        span = slice(turn["completion_start"], turn["completion_end"])
        assert ids[span] == sampled_ids
        assert np.array_equal(
            np.asarray(doc["logprobs"][span], np.float32), np.asarray(sampled_logprobs, np.float32)
        )
        assert turn["worker"] == stack.emulator_url
        assert turn["finish_reason"] == answer["choices"][0]["finish_reason"]
    # Turns 2.. appended only their delta: the worker's cache saw the prefix.
    assert all(t["cached_tokens"] > 0 for t in doc["turns"][1:])
    # The worker was sent exactly the committed prefix each turn.
    sent = [r.body["input_ids"] for r in stack.emulator.requests]
    for turn, input_ids in zip(doc["turns"], sent, strict=True):
        assert input_ids == ids[: turn["completion_start"]]


async def test_think_stripping_template_keeps_sampled_history(
    make_stack: StackFactory, hf_tokenizer: Any
) -> None:
    stack = await make_stack(template="qwen3", emulator=EmulatorConfig(reasoning=True))
    session_id = await stack.create()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Think, then answer."}]
    first = (await stack.chat(session_id, messages=messages, seed=1)).json()
    assert first["choices"][0]["message"]["reasoning_content"]
    before = await stack.trajectory(session_id)
    # Agents usually drop reasoning_content from history: the echo has none.
    messages += [echo(first["choices"][0]["message"]), {"role": "user", "content": "And?"}]
    second = await stack.chat(session_id, messages=messages, seed=2)
    assert second.status_code == 200, second.text
    doc = await stack.trajectory(session_id)
    check_document(doc)

    think = hf_tokenizer.convert_tokens_to_ids("<think>")
    turn0 = doc["turns"][0]
    first_ids = doc["token_ids"][turn0["completion_start"] : turn0["completion_end"]]
    assert first_ids == sampled(first)[0] and think in first_ids
    # The second turn extended the stored ids; history was not re-rendered.
    assert doc["token_ids"][: len(before["token_ids"])] == before["token_ids"]
    assert doc["turns"][1]["prompt_start"] == turn0["completion_end"]
    # ...whereas a re-render strips the earlier <think> block: it differs.
    rerender = hf_tokenizer.apply_chat_template(
        messages,
        chat_template=builtin_template("qwen3"),
        tokenize=False,
        add_generation_prompt=True,
    )
    rerendered_ids = hf_tokenizer(rerender, add_special_tokens=False)["input_ids"]
    assert think not in rerendered_ids
    assert rerendered_ids != doc["token_ids"][: doc["turns"][1]["completion_start"]]


async def test_gate_busy_session_answers_409_without_reaching_the_worker(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(emulator=EmulatorConfig(base_latency_s=1.0))
    session_id = await stack.create()
    messages = [{"role": "user", "content": "hi"}]
    owner: list[Any] = []

    async def run_owner() -> None:
        owner.append(await stack.chat(session_id, messages=messages))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_owner)
        await stack.emulator.wait_for_requests(1)
        contenders: list[Any] = []

        async def contend() -> None:
            contenders.append(await stack.chat(session_id, messages=messages))

        async with trio.open_nursery() as inner:
            for _ in range(3):
                inner.start_soon(contend)
        # All three were answered while the owner's turn was still in flight.
        assert not owner and stack.emulator.inflight == 1
        assert [r.status_code for r in contenders] == [409, 409, 409]
        for response in contenders:
            assert response.json()["error"]["code"] == "session_busy"
            assert response.headers["retry-after"]
    assert owner[0].status_code == 200
    assert stack.emulator.received == 1
    messages += [echo(owner[0].json()["choices"][0]["message"]), {"role": "user", "content": "ok"}]
    assert (await stack.chat(session_id, messages=messages)).status_code == 200


async def test_different_sessions_run_in_parallel(make_stack: StackFactory) -> None:
    stack = await make_stack(emulator=EmulatorConfig(base_latency_s=0.5))
    ids = [await stack.create() for _ in range(3)]
    statuses: list[int] = []

    async def turn(session_id: str) -> None:
        response = await stack.chat(session_id, messages=[{"role": "user", "content": "x"}])
        statuses.append(response.status_code)

    async with trio.open_nursery() as nursery:
        for session_id in ids:
            nursery.start_soon(turn, session_id)
        await stack.emulator.wait_until(lambda: stack.emulator.inflight == 3)
    assert statuses == [200, 200, 200]


async def test_delete_mid_turn_cancels_upstream_and_returns_trajectory_without_it(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(emulator=EmulatorConfig(base_latency_s=30.0))
    session_id = await stack.create()
    turn_response: list[Any] = []

    async def turn() -> None:
        turn_response.append(
            await stack.chat(session_id, messages=[{"role": "user", "content": "long"}])
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await stack.emulator.wait_for_requests(1)
        closed = await stack.client.delete(f"/sessions/{session_id}")
    assert closed.status_code == 200
    doc = closed.json()
    assert doc["status"] == "closed" and doc["closed_at"] is not None
    (segment,) = doc["segments"]
    assert segment["turns"] == [] and segment["token_ids"] == []
    await stack.emulator.wait_for_cancelled(1)
    assert turn_response[0].status_code == 404
    assert turn_response[0].json()["error"]["code"] == "session_closing"
    again = await stack.client.delete(f"/sessions/{session_id}")  # the same document
    assert again.status_code == 200 and again.content == closed.content
    assert (await stack.client.get(f"/sessions/{session_id}")).json()["state"] == "closed"


async def test_chat_while_closing_is_404_session_closing(stack: Stack) -> None:
    session_id = await stack.create()
    session = stack.ctx.registry.get(session_id)
    # The first step of DELETE, with the request still under way.
    assert session.begin_close(0.0) is None
    response = await stack.chat(session_id, messages=[{"role": "user", "content": "x"}])
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "session_closing"
    assert session.state is SessionState.CLOSING and stack.emulator.received == 0


async def test_double_delete_is_200_twice_with_one_document(stack: Stack) -> None:
    session_id = await stack.create()
    first = await stack.client.delete(f"/sessions/{session_id}")
    second = await stack.client.delete(f"/sessions/{session_id}")
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.content == second.content
    response = await stack.chat(session_id, messages=[{"role": "user", "content": "x"}])
    assert response.json()["error"]["code"] == "session_not_found"


@pytest.mark.parametrize("max_tokens", [3], ids=["length"])
async def test_truncated_turn_gets_turn_end_tokens_with_mask_0(
    stack: Stack, hf_tokenizer: Any, max_tokens: int
) -> None:
    session_id = await stack.create()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story."}]
    first = (await stack.chat(session_id, messages=messages, max_tokens=max_tokens)).json()
    assert first["choices"][0]["finish_reason"] == "length"
    messages += [echo(first["choices"][0]["message"]), {"role": "user", "content": "Go on."}]
    assert (await stack.chat(session_id, messages=messages)).status_code == 200
    doc = await stack.trajectory(session_id)
    check_document(doc)
    turn0, turn1 = doc["turns"]
    assert turn0["completion_end"] - turn0["completion_start"] == max_tokens
    # The next prompt starts with what the template closes a turn with.
    pieces = hf_tokenizer.convert_ids_to_tokens(
        doc["token_ids"][turn1["prompt_start"] : turn1["prompt_start"] + 3]
    )
    assert pieces == ["<|im_end|>", "Ċ", "<|im_start|>"]


async def test_the_worker_gets_the_kwargs_the_prompt_was_rendered_with(
    make_stack: StackFactory,
) -> None:
    """Server defaults merged under the request's own: SGLang's reasoning
    parsers read them to split the answer in the mode the prompt set."""
    stack = await make_stack(template="qwen3", chat_template_kwargs={"enable_thinking": False})
    session_id = await stack.create()
    user = [{"role": "user", "content": "hi"}]
    response = await stack.chat(session_id, messages=user, chat_template_kwargs={"x": 1})
    assert response.status_code == 200, response.text
    sent = stack.emulator.requests[-1].body
    assert sent["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}
