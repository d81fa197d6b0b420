"""Segments (docs/training.md#segments): what real agents do to their history,
reproduced with the official `openai` SDK against the emulator, and what the
trajectory keeps of it.

Every test checks the promise: no sampled token is lost — the mask-1 tokens
of every segment are the sampled tokens of every 200 answer, except the
answers a retry replaced — and each segment keeps the export's invariants.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from rollout_session.emulator.worker import EmulatorConfig
from tests.conftest import OTHER_TOOLS, TOOLS, Stack, StackFactory
from tests.integration.conftest import closed_after_test
from tests.integration.protocols.test_sdk import MODEL, base_url
from tests.integration.session.test_turns import answered, check_document, echo
from tests.loopback import TLS

pytestmark = pytest.mark.usefixtures("close_sdk_clients")

SYSTEM = {"role": "system", "content": "You are a coding agent."}
USER_1 = {"role": "user", "content": "What does main.py print?"}


@dataclass
class Agent:
    """An agent on the official SDK that records every answer it was given."""

    client: openai.AsyncOpenAI
    tools: list[dict[str, Any]] | None = field(default_factory=lambda: TOOLS)
    answers: list[dict[str, Any]] = field(default_factory=list)
    replaced: list[int] = field(default_factory=list)  # answers a retry replaced

    async def call(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        request: dict[str, Any] = {"model": MODEL, "messages": messages, **kwargs}
        if self.tools:
            request["tools"] = self.tools
        completion = await self.client.chat.completions.create(**request)
        answer = completion.model_dump()
        self.answers.append(answer)
        message: dict[str, Any] = answer["choices"][0]["message"]
        return message

    async def retry(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """The previous request again, as after a lost answer."""
        self.replaced.append(len(self.answers) - 1)
        return await self.call(messages, **kwargs)


def sampled_ids(answer: dict[str, Any]) -> list[int]:
    return [e[1] for e in answer["choices"][0]["meta_info"]["output_token_logprobs"]]


def check_nothing_lost(doc: dict[str, Any], agent: Agent) -> None:
    """Every kept answer's sampled ids are one turn's completion, in some
    segment, and the segments hold no other mask-1 token."""
    assert doc["schema_version"] == 3 and doc["num_segments"] == len(doc["segments"])
    completions = []
    for index, segment in enumerate(doc["segments"]):
        assert segment["index"] == index
        check_document(segment)
        ids = segment["token_ids"]
        completions += [ids[t["completion_start"] : t["completion_end"]] for t in segment["turns"]]
    kept = [sampled_ids(a) for i, a in enumerate(agent.answers) if i not in agent.replaced]
    assert completions == kept
    sampled = sum(sum(s["loss_mask"]) for s in doc["segments"])
    assert sampled == sum(map(len, kept))
    # The books balance from the document alone: every answer's tokens are
    # in a segment or counted as dropped by a rollback.
    every = sum(a["usage"]["completion_tokens"] for a in agent.answers)
    assert every == sampled + sum(r["dropped_tokens"] for r in doc["rollbacks"])
    # Each segment once: no copy of the last one at the top level.
    assert not {"token_ids", "turns", "messages"} & doc.keys()


def branches(doc: dict[str, Any]) -> list[Any]:
    return [s["branch"] for s in doc["segments"]]


def client(url: str, **options: Any) -> openai.AsyncOpenAI:
    """An SDK client, closed when the test ends."""
    return closed_after_test(
        openai.AsyncOpenAI(
            **{"api_key": "unused", "max_retries": 0, **options},
            base_url=url,
            http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
        )
    )


async def episode(stack: Stack, **agent: Any) -> tuple[str, Agent]:
    session_id = await stack.create()
    return session_id, Agent(client(base_url(stack, session_id)), **agent)


async def first_answer(agent: Agent) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    messages = [SYSTEM, USER_1]
    return messages, await agent.call(messages, seed=1)


async def test_a_dropped_reasoning_only_answer_starts_a_segment(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(template="qwen3", emulator=EmulatorConfig(reasoning=True))
    session_id, agent = await episode(stack, tools=None)
    messages = [USER_1]
    # Cut inside its thinking: reasoning_content only, empty content.
    answer = await agent.call(messages, max_tokens=3)
    assert answer["reasoning_content"] and not answer["content"]
    # The SDK keeps no empty message and asks again with the same input.
    await agent.call(messages)
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert branches(doc) == [None, {"reason": "answer_dropped", "segment": 0, "message": 1}]
    assert doc["rollbacks"] == []


async def test_a_dropped_answer_with_a_nudge_starts_a_segment(stack: Stack) -> None:
    """mini-swe-agent: an answer without the tool call it wants is dropped
    and a user message asks for one."""
    session_id, agent = await episode(stack)
    messages, _ = await first_answer(agent)
    nudge = {"role": "user", "content": "No tool calls found. Call exactly one tool."}
    await agent.call([*messages, nudge])
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    # v1's document (?schema=1) is the last segment, and says how many there are.
    v1 = await stack.trajectory(session_id, schema=1)
    last = doc["segments"][-1]
    assert (v1["schema_version"], v1["num_segments"]) == (1, 2)
    assert (v1["token_ids"], v1["turns"], v1["messages"]) == (
        last["token_ids"],
        last["turns"],
        last["messages"],
    )
    assert branches(doc) == [None, {"reason": "answer_dropped", "segment": 0, "message": 2}]
    # The new segment is the render of the request: it starts with the same prompt.
    first, second = doc["segments"]
    assert (
        second["token_ids"][: first["prompt_length"] - 4]
        == first["token_ids"][: first["prompt_length"] - 4]
    )


async def test_tool_calls_re_sent_as_text_start_a_segment_each_time(stack: Stack) -> None:
    """smolagents: the history carries the model's tool calls as assistant
    text and their results as user observations: every call diverges."""
    session_id, agent = await episode(stack)
    messages = [SYSTEM, USER_1]
    for step in range(4):
        answer = await agent.call(messages, seed=step)
        text = answer["content"] or f"Calling tools: {answer['tool_calls']}"
        messages = [
            *messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Observation: step {step}"},
        ]
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert doc["num_segments"] == 4
    assert [b and (b["reason"], b["message"]) for b in branches(doc)] == [
        None,
        ("answer_edited", 2),
        ("answer_edited", 4),
        ("answer_edited", 6),
    ]
    assert [len(s["turns"]) for s in doc["segments"]] == [1, 1, 1, 1]


async def test_changed_tools_start_a_segment(stack: Stack) -> None:
    session_id, agent = await episode(stack)
    messages, answer = await first_answer(agent)
    agent.tools = OTHER_TOOLS
    await agent.call([*messages, *answered(answer), {"role": "user", "content": "go on"}])
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert branches(doc) == [None, {"reason": "tools_changed", "segment": 0, "message": 0}]


async def test_compacted_history_starts_a_segment(stack: Stack) -> None:
    session_id, agent = await episode(stack)
    messages, answer = await first_answer(agent)
    messages = [*messages, *answered(answer), {"role": "user", "content": "and then?"}]
    answer = await agent.call(messages)
    summary = {"role": "user", "content": "Summary so far: main.py prints 0."}
    await agent.call([SYSTEM, summary, {"role": "user", "content": "Continue."}])
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert branches(doc) == [None, {"reason": "history_edited", "segment": 0, "message": 1}]
    assert [len(s["turns"]) for s in doc["segments"]] == [2, 1]


@pytest.mark.parametrize(
    ("role", "segments"), [("system", 1), ("developer", 2)], ids=["in-place", "not-in-place"]
)
async def test_an_appended_system_or_developer_message(
    stack: Stack, role: str, segments: int
) -> None:
    """An agent appends a system reminder after the answer (a pydantic-ai
    `SystemPromptPart` in its history). ChatML renders a system message in
    place (the start-up check says so): the segment goes on. It drops a
    developer message: a new segment."""
    session_id, agent = await episode(stack)
    messages, answer = await first_answer(agent)
    reminder = {"role": role, "content": "Answer with a tool call."}
    await agent.call([*messages, echo(answer), reminder])
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert doc["num_segments"] == segments
    if segments == 2:
        assert branches(doc)[1] == {"reason": "appended_role", "segment": 0, "message": 3}


async def test_a_retry_replaces_the_last_turn_visibly(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    session_id, agent = await episode(stack)
    messages, answer = await first_answer(agent)
    messages = [*messages, *answered(answer), {"role": "user", "content": "and then?"}]
    await agent.call(messages)
    with caplog.at_level(logging.INFO, logger="rollout_session"):
        await agent.retry(messages, seed=7)
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert doc["num_segments"] == 1
    (rollback,) = doc["rollbacks"]
    assert {k: rollback[k] for k in ("reason", "segment", "turn", "dropped_turns")} == {
        "reason": "retry",
        "segment": 0,
        "turn": 1,
        "dropped_turns": 1,
    }
    assert stack.ctx.metrics.rollbacks.labels("retry")._value.get() == 1
    assert any("rollback (retry)" in m for m in caplog.messages)


async def test_a_client_timeout_and_its_retry_lose_nothing(make_stack: StackFactory) -> None:
    """The SDK gives up on a slow answer and sends the request again: the
    server cancels the abandoned turn (nothing committed), the retry extends."""
    stack = await make_stack(emulator=EmulatorConfig(base_latency_s=0.5))
    session_id = await stack.create()
    agent = Agent(client(base_url(stack, session_id), max_retries=1, timeout=0.3))
    with pytest.raises(openai.APITimeoutError):
        await agent.call([SYSTEM, USER_1])
    agent.client = client(base_url(stack, session_id))
    messages, answer = await first_answer(agent)
    await agent.call([*messages, *answered(answer), {"role": "user", "content": "and then?"}])
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert (doc["num_segments"], doc["rollbacks"]) == (1, [])


async def test_a_segment_is_extended_like_a_session(stack: Stack) -> None:
    """After a branch, turns extend the new segment token-in/token-out."""
    session_id, agent = await episode(stack)
    messages, _ = await first_answer(agent)
    messages = [*messages, {"role": "user", "content": "Use a tool, please."}]
    answer = await agent.call(messages)
    for step in range(3):
        messages = [*messages, *answered(answer), {"role": "user", "content": f"step {step}"}]
        answer = await agent.call(messages)
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert [len(s["turns"]) for s in doc["segments"]] == [1, 4]
    # The worker was sent the new segment's ids, extended turn by turn.
    sent = [r.body["input_ids"] for r in stack.emulator.requests][1:]
    second = doc["segments"][1]
    for turn, input_ids in zip(second["turns"], sent, strict=True):
        assert input_ids == second["token_ids"][: turn["completion_start"]]


@pytest.mark.parametrize(
    ("second", "code"),
    [
        ([SYSTEM, {"role": "user", "content": "another question"}], "trajectory_diverged"),
        ([SYSTEM, USER_1, {"role": "user", "content": "please"}], "trajectory_diverged"),
    ],
    ids=["history_edited", "answer_dropped"],
)
async def test_on_divergence_error_refuses_with_400_and_keeps_the_session(
    make_stack: StackFactory, second: list[dict[str, Any]], code: str
) -> None:
    stack = await make_stack(on_divergence="error")
    session_id, agent = await episode(stack)
    messages, _ = await first_answer(agent)
    before = await stack.trajectory(session_id, schema=3)
    with pytest.raises(openai.BadRequestError) as refused:
        await agent.call(second)
    assert refused.value.status_code == 400
    assert refused.value.code == code
    assert "--on-divergence error" in refused.value.message
    assert await stack.trajectory(session_id, schema=3) == before
    # A retry and an extension still work.
    await agent.retry(messages)
    await agent.call([*messages, *answered(agent.answers[-1]["choices"][0]["message"]), USER_1])
    check_nothing_lost(await stack.trajectory(session_id, schema=3), agent)


async def test_export_views_cover_every_segment(stack: Stack) -> None:
    session_id, agent = await episode(stack)
    messages, answer = await first_answer(agent)
    await agent.call([*messages, *answered(answer), {"role": "user", "content": "more"}])
    await agent.call([SYSTEM, {"role": "user", "content": "start over"}])
    doc = await stack.trajectory(session_id, schema=3)
    samples = (
        await stack.client.get(f"/sessions/{session_id}/trajectory", params={"format": "sample"})
    ).json()["samples"]
    assert [s["episode_id"] for s in samples] == [session_id, session_id]
    for sample, segment in zip(samples, doc["segments"], strict=True):
        start = segment["prompt_length"]
        assert sample["tokens"] == segment["token_ids"]
        assert sample["loss_mask"] == segment["loss_mask"][start:]
        assert sample["branch"] == segment["branch"]
    steps = (
        await stack.client.get(f"/sessions/{session_id}/trajectory", params={"format": "steps"})
    ).json()["steps"]
    assert [(s["step"], s["segment"], s["turn"], s["is_last"]) for s in steps] == [
        (0, 0, 0, False),
        (1, 0, 1, False),
        (2, 1, 0, True),
    ]
    for step, answer in zip(steps, agent.answers, strict=True):
        segment = doc["segments"][step["segment"]]
        turn = segment["turns"][step["turn"]]
        assert step["prompt_ids"] == segment["token_ids"][: turn["completion_start"]]
        assert step["response_ids"] == sampled_ids(answer)
        assert step["response_mask"] == [1] * len(step["response_ids"])
    # DELETE takes the same views.
    closed = (
        await stack.client.delete(f"/sessions/{session_id}", params={"format": "steps"})
    ).json()
    assert (closed["status"], closed["steps"]) == ("closed", steps)


async def test_prompt_mode_render_extends_what_renders_the_same(stack_render: Stack) -> None:
    """ChatML re-renders history as it was sampled: one segment, and every
    turn's prompt is the template's whole render of the request."""
    stack = stack_render
    session_id, agent = await episode(stack)
    messages, answer = await first_answer(agent)
    for step in range(2):
        messages = [*messages, *answered(answer), {"role": "user", "content": f"step {step}"}]
        answer = await agent.call(messages)
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert doc["num_segments"] == 1


@pytest.fixture
async def stack_render(make_stack: StackFactory) -> Stack:
    return await make_stack(prompt_mode="render")


async def test_prompt_mode_render_starts_a_segment_where_the_template_rewrites(
    make_stack: StackFactory,
) -> None:
    """Qwen3 strips earlier <think> blocks: the render of the next request no
    longer starts with what the model saw, so it starts a segment whose
    prompt is exactly what the template renders."""
    stack = await make_stack(
        template="qwen3", prompt_mode="render", emulator=EmulatorConfig(reasoning=True)
    )
    session_id, agent = await episode(stack, tools=None)
    messages = [USER_1]
    answer = await agent.call(messages, seed=1)
    assert answer["reasoning_content"]
    messages = [*messages, *answered(answer), {"role": "user", "content": "And?"}]
    await agent.call(messages, seed=2)
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert branches(doc) == [
        None,
        {"reason": "rendered_differently", "segment": 0, "message": 1},
    ]
    # The second prompt is the template's own render of the request.
    rendered = stack.ctx.turn_runner.tokenizer.first_turn(messages, tools=None, kwargs={})
    second = doc["segments"][1]
    assert second["token_ids"][: second["prompt_length"]] == rendered


async def test_prompt_mode_render_with_on_divergence_error_refuses(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(
        template="qwen3",
        prompt_mode="render",
        on_divergence="error",
        emulator=EmulatorConfig(reasoning=True),
    )
    _, agent = await episode(stack, tools=None)
    answer = await agent.call([USER_1], seed=1)
    with pytest.raises(openai.BadRequestError) as refused:
        await agent.call([USER_1, *answered(answer), {"role": "user", "content": "And?"}])
    assert refused.value.code == "trajectory_diverged"
    assert "renders this request's history differently" in refused.value.message


async def test_segments_survive_a_restart_exactly(make_stack: StackFactory, tmp_path: Path) -> None:
    stack = await make_stack(journal=str(tmp_path), journal_fsync="always")
    session_id, agent = await episode(stack)
    messages, answer = await first_answer(agent)
    await agent.call([*messages, {"role": "user", "content": "Use a tool."}])  # answer_dropped
    agent.tools = OTHER_TOOLS
    extended = [*messages, {"role": "user", "content": "Search."}]
    answer = await agent.call(extended)  # tools_changed
    await agent.retry(extended, seed=3)
    before = await stack.trajectory(session_id, schema=3)
    assert before["num_segments"] == 3 and len(before["rollbacks"]) == 1
    await stack.server.aclose()  # the journal is flushed; a new server replays it
    again = await make_stack(journal=str(tmp_path))
    assert await again.trajectory(session_id, schema=3) == before
    # The restored session goes on in its last segment.
    agent.client = client(base_url(again, session_id))
    answer = agent.answers[-1]["choices"][0]["message"]
    await agent.call([*extended, *answered(answer), {"role": "user", "content": "more"}])
    doc = await again.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert [len(s["turns"]) for s in doc["segments"]] == [1, 1, 2]


async def test_segments_past_the_cap_are_refused_and_the_session_goes_on(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(max_segments=2)
    session_id, agent = await episode(stack)
    messages, _ = await first_answer(agent)
    second = [*messages, {"role": "user", "content": "Use a tool."}]
    answer = await agent.call(second)  # segment 1
    before = await stack.trajectory(session_id, schema=3)
    received = stack.emulator.received
    with pytest.raises(openai.BadRequestError) as refused:
        await agent.call([SYSTEM, {"role": "user", "content": "start over"}])
    assert refused.value.code == "too_many_segments"
    assert stack.emulator.received == received
    assert await stack.trajectory(session_id, schema=3) == before
    # Its last segment still takes a retry and an extension.
    answer = await agent.retry(second)
    await agent.call([*second, *answered(answer), {"role": "user", "content": "go on"}])
    doc = await stack.trajectory(session_id, schema=3)
    check_nothing_lost(doc, agent)
    assert doc["num_segments"] == 2
