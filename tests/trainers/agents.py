"""The agents the trainer adapters' tests run: each an ``async def
solve(session, row)`` on the official OpenAI SDK, as a user writes one
(docs/trainers.md), named to the adapters by ``"tests.trainers.agents:NAME"``.
The row's prompt is read as ``raw_prompt`` (verl's name; SkyRL's row has it
too), so one function serves both trainers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import openai

from rollout_session.trainers import AgentSession
from tests.conftest import TOOLS
from tests.loopback import TLS

__all__ = ["raising_agent", "rewriting_agent", "silent_agent", "tool_agent"]


def _client(session: AgentSession) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=session.base_url,
        api_key=session.api_key,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
    )


def _prompt(row: Mapping[str, Any]) -> list[Any]:
    return list(row["raw_prompt"])


def _assistant(message: Any) -> dict[str, Any]:
    echoed: dict[str, Any] = message.model_dump(exclude_none=True)
    return echoed


async def tool_agent(session: AgentSession, row: Mapping[str, Any]) -> float:
    """The model calls the tool; the agent answers with its result; the
    model's final text is scored 1.0. Sends its own temperature (0.3),
    which the session's pinned sampling (the trainer's) replaces."""
    messages: list[Any] = list(row["raw_prompt"])
    tools: Any = TOOLS
    async with _client(session) as client:
        for _ in range(4):
            answer = await client.chat.completions.create(
                model=session.model, messages=messages, tools=tools, temperature=0.3
            )
            message = answer.choices[0].message
            messages.append(_assistant(message))
            if not message.tool_calls:
                return 1.0 if message.content else 0.0
            for call in message.tool_calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": "print('hello')"}
                )
    return 0.0


async def rewriting_agent(session: AgentSession, row: Mapping[str, Any]) -> float:
    """Two turns; the second request rewrites the first user message (a
    compacted history): the session starts a second segment."""
    prompt: list[Any] = list(row["raw_prompt"])
    async with _client(session) as client:
        first = await client.chat.completions.create(model=session.model, messages=prompt)
        compacted: list[Any] = [
            {
                "role": "user",
                "content": "Summary of the task so far: " + str(prompt[-1]["content"]),
            },
            _assistant(first.choices[0].message),
            {"role": "user", "content": "Go on."},
        ]
        await client.chat.completions.create(model=session.model, messages=compacted)
    return 0.5


class AgentCrashed(RuntimeError):
    pass


async def raising_agent(session: AgentSession, row: Mapping[str, Any]) -> float:
    """One turn, then the harness fails."""
    async with _client(session) as client:
        await client.chat.completions.create(model=session.model, messages=_prompt(row))
    raise AgentCrashed("the tool sandbox died")


async def silent_agent(session: AgentSession, row: Mapping[str, Any]) -> None:
    """One turn and no reward (leaves the scoring to the trainer)."""
    async with _client(session) as client:
        await client.chat.completions.create(model=session.model, messages=_prompt(row))
