"""The agent side through the official `openai` SDK, unmodified."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio

from .conftest import TOOLS, Stack
from .test_turns import check_document


def agent_episode(base_url: str) -> list[Any]:
    """A plain synchronous tool-calling agent, as users write them."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages: list[Any] = [{"role": "user", "content": "What is in main.py?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, seed=3)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "print('hi')"})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, seed=4)
    assert final.choices[0].message.content
    messages.append(final.choices[0].message.model_dump(exclude_none=True))
    client.close()
    return messages


async def test_sync_sdk_tool_conversation(stack: Stack) -> None:
    session_id = await stack.create()
    messages = await trio.to_thread.run_sync(agent_episode, f"{stack.url}/sessions/{session_id}/v1")
    doc = await stack.trajectory(session_id)
    check_document(doc)
    assert len(doc["turns"]) == 2
    assert doc["messages"][-1]["content"] == messages[-1]["content"]


async def test_async_sdk_under_trio(stack: Stack) -> None:
    session_id = await stack.create()
    client = openai.AsyncOpenAI(
        base_url=f"{stack.url}/sessions/{session_id}/v1", api_key="unused", max_retries=0
    )
    try:
        answer = await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hello"}]
        )
    finally:
        await client.close()
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens > 0


def call_expecting(base_url: str, exc_type: type[Exception], **kwargs: Any) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(exc_type) as info:
        client.chat.completions.create(model="any", **kwargs)
    client.close()
    return str(info.value)


async def test_sdk_raises_typed_errors_with_our_message(stack: Stack) -> None:
    session_id = await stack.create()
    base = f"{stack.url}/sessions/{session_id}/v1"
    user = [{"role": "user", "content": "x"}]
    message = await trio.to_thread.run_sync(
        lambda: call_expecting(base, openai.BadRequestError, messages=user, n=2)
    )
    assert "only n=1 is supported" in message
    message = await trio.to_thread.run_sync(
        lambda: call_expecting(f"{stack.url}/sessions/nope/v1", openai.NotFoundError, messages=user)
    )
    assert "session nope does not exist" in message
