"""An example agent for every trainer (docs/trainers.md#the-agent): the
official OpenAI SDK, one tool, turns until the model stops calling it.

Name it in a trainer's config as
``rollout_session.trainers.example_agent:solve``. It reads the row's
prompt messages (verl's ``raw_prompt``, SkyRL's ``prompt``, or
``messages``) and returns None: the trainer's own reward scores the
episode. Needs ``openai`` (the ``demo`` extra).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from .agent import AgentSession

__all__ = ["TOOLS", "prompt_messages", "solve"]

# The example's one tool; its "file" is the path it was asked for.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]

# Model calls per episode, at most.
MAX_TURNS = 4


def prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a trainer's dataset row starts the episode with."""
    for key in ("raw_prompt", "prompt", "messages"):
        messages = row.get(key)
        if isinstance(messages, list) and messages:
            return [dict(m) for m in messages]
    raise ValueError(f"the row has no prompt messages (raw_prompt, prompt or messages): {row!r}")


def read_file(arguments: str) -> str:
    """The tool: a file's 'content' (its path, said back)."""
    try:
        path = orjson.loads(arguments).get("path", "")
    except (orjson.JSONDecodeError, AttributeError):
        return "error: the arguments are not a JSON object"
    return f"contents of {path}"


async def solve(session: AgentSession, row: Mapping[str, Any]) -> float | None:
    from openai import AsyncOpenAI

    messages = prompt_messages(row)
    async with AsyncOpenAI(
        base_url=session.base_url, api_key=session.api_key, max_retries=0
    ) as client:
        for _ in range(MAX_TURNS):
            answer = await client.chat.completions.create(
                model=session.model,
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
            )
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                arguments = getattr(getattr(call, "function", None), "arguments", "")
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": read_file(arguments)}
                )
    return None
