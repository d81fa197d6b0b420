"""The OpenAI Responses API on a session (docs/api.md#post-sessionsidv1responses),
through the official `openai` SDK: the same turns as chat completions."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from rollout_session.emulator import EmulatorConfig
from tests.conftest import TOOLS, Stack, StackFactory
from tests.integration.conftest import closed_after_test
from tests.integration.http.test_root_routes import (
    episode as chat_episode,  # the same loop in chat completions
)
from tests.integration.protocols.test_sdk import MODEL
from tests.integration.session.test_turns import check_document
from tests.loopback import TLS

pytestmark = pytest.mark.usefixtures("close_sdk_clients")

USER = "What does main.py print?"
RESPONSES_TOOLS: list[dict[str, Any]] = [
    {"type": "function", **tool["function"]}  # type: ignore[dict-item]
    for tool in TOOLS
]


def client(stack: Stack, session_id: str) -> openai.AsyncOpenAI:
    return closed_after_test(
        openai.AsyncOpenAI(
            base_url=f"{stack.url}/sessions/{session_id}/v1",
            api_key="unused",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
        )
    )


def committed(doc: dict[str, Any]) -> tuple[Any, ...]:
    return (doc["token_ids"], doc["loss_mask"], doc["logprobs"], doc["num_segments"])


async def responses_episode(
    agent: openai.AsyncOpenAI, turns: int, *, stream: bool = False, chained: bool = False
) -> list[Any]:
    """A tool loop in the Responses API: the output items go back as input,
    or only the new items after `previous_response_id` when `chained`."""
    items: list[Any] = [{"role": "user", "content": USER}]
    new: list[Any] = list(items)
    previous = None
    responses = []
    for i in range(turns):
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "input": new if chained else items,
            "tools": RESPONSES_TOOLS,
            "extra_body": {"seed": i},
        }
        if chained and previous is not None:
            kwargs["previous_response_id"] = previous
        if stream:
            async with agent.responses.stream(**kwargs) as events:
                response = await events.get_final_response()
        else:
            response = await agent.responses.create(**kwargs)
        responses.append(response)
        previous = response.id
        output = [item.model_dump(exclude_none=True) for item in response.output]
        new = []
        for item in output:
            if item["type"] == "function_call":
                new.append(
                    {"type": "function_call_output", "call_id": item["call_id"], "output": f"r{i}"}
                )
        if not new:
            new.append({"role": "user", "content": f"next {i}"})
        items += [*output, *new]
    return responses


@pytest.mark.parametrize(
    "mode", ["create", "stream", "chained"], ids=["create", "stream", "previous-response-id"]
)
async def test_a_responses_episode_is_the_chat_episode(make_stack: StackFactory, mode: str) -> None:
    trajectories = []
    for protocol in ("chat", "responses"):
        stack = await make_stack()
        session_id = await stack.create()
        agent = client(stack, session_id)
        if protocol == "chat":
            await chat_episode(agent, turns=4)
        else:
            responses = await responses_episode(
                agent, turns=4, stream=mode == "stream", chained=mode == "chained"
            )
            assert any(item.type == "function_call" for r in responses for item in r.output)
            assert all(r.status == "completed" and r.usage is not None for r in responses)
        doc = await stack.trajectory(session_id)
        check_document(doc)
        trajectories.append(committed(doc))
    assert trajectories[0] == trajectories[1]
    assert trajectories[0][3] == 1  # one segment: every turn extended the last


async def test_reasoning_items_go_back_and_extend(make_stack: StackFactory) -> None:
    stack = await make_stack(template="qwen3", emulator=EmulatorConfig(reasoning=True))
    session_id = await stack.create()
    agent = client(stack, session_id)
    first = await agent.responses.create(model=MODEL, input=USER, extra_body={"seed": 1})
    kinds = [item.type for item in first.output]
    assert kinds[0] == "reasoning" and "message" in kinds
    items: Any = [
        {"role": "user", "content": USER},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And?"},
    ]
    second = await agent.responses.create(model=MODEL, input=items)
    assert second.output_text
    doc = await stack.trajectory(session_id)
    assert doc["num_segments"] == 1 and len(doc["turns"]) == 2


async def test_a_response_cut_by_max_output_tokens_is_incomplete(stack: Stack) -> None:
    session_id = await stack.create()
    response = await client(stack, session_id).responses.create(
        model=MODEL, input=USER, max_output_tokens=3
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3


@pytest.mark.parametrize(
    ("request_fields", "param"),
    [
        ({"input": USER, "tools": [{"type": "web_search"}]}, "tools[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": USER, "background": True}, "background"),
        ({"input": USER, "previous_response_id": "resp_0_7_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": USER, "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": USER, "text": {"format": {"type": "xml"}}}, "text.format"),
    ],
    ids=[
        "builtin-tool",
        "image",
        "item-reference",
        "background",
        "unknown-previous",
        "empty-input",
        "builtin-tool-choice",
        "bad-format",
    ],
)
async def test_what_is_not_supported_is_400_naming_it(
    stack: Stack, request_fields: dict[str, Any], param: str
) -> None:
    session_id = await stack.create()
    with pytest.raises(openai.BadRequestError) as refused:
        await client(stack, session_id).responses.create(model=MODEL, **request_fields)
    assert refused.value.code == "invalid_request"
    assert refused.value.param == param
    assert stack.emulator.received == 0
    assert (await stack.trajectory(session_id))["turns"] == []


async def test_responses_at_the_root_with_the_session_header(stack: Stack) -> None:
    session_id = await stack.create()
    agent = openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Session-ID": session_id},
        http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
    )
    closed_after_test(agent)
    response = await agent.responses.create(model=MODEL, input=USER)
    assert response.output_text
    assert len((await stack.trajectory(session_id))["turns"]) == 1
