"""pydantic-ai's Agent with OpenAIChatModel against `serve --demo`.

What pydantic-ai does to the history: it keeps its own `ModelMessage` list and
maps it to chat messages on every call. Instructions are rendered afresh as
the first system message of every request (dynamic instructions that change
between steps or runs edit message 0). A tool that becomes available mid-run
changes `tools` and is announced by a *system* message placed after the tool
results ("The following tool(s) are now available: …"); the next run's
requests leave that message out again. A history processor (the
`ProcessHistory` capability) may cut the history. A system prompt part the
user adds to `message_history` becomes a mid-conversation system message.

Each episode runs under every engine (`--engine sglang-chat`,
`sglang-generate` and `vllm`): the same answers and the same trajectory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import ProcessHistory
from pydantic_ai.messages import ModelRequest, SystemPromptPart, UserPromptPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.tools import ToolDefinition

from tests.frameworks.harness import (
    DemoServer,
    Episode,
    ModelCall,
    Recorder,
    check_episode,
    check_same_across_engines,
    demo_servers,
    dump,
)

MODEL = "rollout-session/emulator"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, DemoServer]]:
    with demo_servers() as running:
        yield running


def _weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def _add(a: int, b: int) -> int:
    """The sum of two integers."""
    return a + b


async def _after_first_step(ctx: RunContext[Any], tool: ToolDefinition) -> ToolDefinition | None:
    """`add` is offered from a run's second model call on."""
    return tool if ctx.run_step > 1 else None


def _recent_only(messages: list[Any]) -> list[Any]:
    """A context budget: the first request and the last three messages."""
    return messages[:1] + messages[-3:] if len(messages) > 5 else messages


def _agent(provider: OpenAIProvider, kind: str) -> Agent[None, str]:
    capabilities = [ProcessHistory(_recent_only)] if kind == "history-processor" else []
    agent: Agent[None, str] = Agent(
        OpenAIChatModel(MODEL, provider=provider), capabilities=capabilities
    )

    def instructions(ctx: RunContext[None]) -> str:
        if kind == "dynamic-instructions":
            return f"You help. This is step {ctx.run_step}."
        return "You help."

    agent.instructions(instructions)
    agent.tool_plain(_weather)
    if kind == "tool-appears":
        agent.tool_plain(prepare=_after_first_step)(_add)
    return agent


async def _episode(base_url: str, recorder: Recorder, kind: str, questions: int) -> None:
    async with httpx2.AsyncClient(event_hooks={"response": [recorder.async_hook]}) as http:
        provider = OpenAIProvider(base_url=base_url, api_key="unused", http_client=http)
        agent = _agent(provider, kind)
        history: list[Any] | None = None
        for i in range(questions):
            question = f"Question {i}: the weather in Paris?"
            if kind == "system-reminder" and history is not None:
                reminder = ModelRequest(
                    parts=[SystemPromptPart("Be brief."), UserPromptPart(question)]
                )
                result = await agent.run(message_history=[*history, reminder])
            else:
                result = await agent.run(question, message_history=history)
            history = result.all_messages()


KINDS = [
    "multi-run",
    "dynamic-instructions",
    "tool-appears",
    "history-processor",
    "system-reminder",
]


def _checked_episode(
    server: DemoServer, engine: str, kind: str
) -> tuple[list[ModelCall], dict[str, Any], Episode]:
    recorder = Recorder()
    session_id, base_url = server.create_session(
        {"framework": "pydantic-ai", "kind": kind, "engine": engine}
    )
    asyncio.run(_episode(base_url, recorder, kind, questions=3))
    doc = server.close_session(session_id)
    calls = recorder.take()
    dump(f"pydantic-ai-{engine}", calls, doc)
    assert all(c.status == 200 for c in calls), [c.response for c in calls if c.status != 200]
    return calls, doc, check_episode(f"pydantic-ai ({kind}, {engine})", calls, doc)


@pytest.mark.parametrize("kind", KINDS, ids=KINDS)
def test_every_sampled_token_is_exported(
    servers: dict[str, DemoServer], episodes: list[Episode], kind: str
) -> None:
    runs: dict[str, tuple[list[ModelCall], dict[str, Any]]] = {}
    for engine, server in servers.items():
        calls, doc, episode = _checked_episode(server, engine, kind)
        episodes.append(episode)
        runs[engine] = calls, doc
        assert episode.ok_calls >= 6
        if kind == "multi-run":
            assert episode.segments == 1, server.log_tail()
        elif kind != "system-reminder":
            assert episode.segments > 1, server.log_tail()
    assert check_same_across_engines(f"pydantic-ai ({kind})", runs) >= 1
