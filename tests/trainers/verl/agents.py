"""The agents the verl suite names in its YAML (``module:function``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from openai import AsyncOpenAI

from rollout_session.trainers import AgentSession
from rollout_session.trainers.example_agent import prompt_messages, solve

__all__ = ["raising", "rewriting", "scored", "solve"]

# What `scored` and `rewriting` return.
REWARD = 0.5


def _client(session: AgentSession) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


async def scored(session: AgentSession, row: Mapping[str, Any]) -> float | None:
    """One turn, rewarded `REWARD`."""
    async with _client(session) as client:
        await client.chat.completions.create(
            model=session.model,
            messages=prompt_messages(row),  # type: ignore[arg-type]
            temperature=1.7,  # the trainer's sampling is pinned: this is not sampled with
        )
    return REWARD


async def rewriting(session: AgentSession, row: Mapping[str, Any]) -> float | None:
    """Two turns, then a third over a history it rewrote (its first
    message summarised, as a compacting framework does): two segments."""
    messages = prompt_messages(row)
    async with _client(session) as client:
        for _ in range(2):
            answer = await client.chat.completions.create(
                model=session.model,
                messages=messages,  # type: ignore[arg-type]
            )
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            messages.append({"role": "user", "content": "go on"})
        compacted = [{"role": "user", "content": "summary of the task so far"}]
        await client.chat.completions.create(
            model=session.model,
            messages=compacted,  # type: ignore[arg-type]
        )
    return REWARD


class AgentBroke(RuntimeError):
    pass


async def raising(session: AgentSession, row: Mapping[str, Any]) -> float | None:
    """One turn, then the agent fails."""
    async with _client(session) as client:
        await client.chat.completions.create(
            model=session.model,
            messages=prompt_messages(row),  # type: ignore[arg-type]
        )
    raise AgentBroke("the agent's harness crashed")
