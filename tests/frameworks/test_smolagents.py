"""smolagents' ToolCallingAgent against `serve --demo`.

What smolagents does to the history: it keeps its own memory of steps and
re-renders it as messages on every call. The model's tool calls come back as
assistant *text* ("Calling tools:\\n[{...}]") and their results as *user*
messages ("Observation: ..."), so every request after the first differs from
the model's answer at the first assistant message: each call starts a new
segment (`answer_dropped`). A planning step (`planning_interval`) and the
final answer after `max_steps` are asked with other system prompts and no
tools. A second `run(..., reset=False)` continues the same memory.

Under `--engine sglang-chat` and `--engine vllm`, each checked on its own
(every sampled token exported), not against each other: its prompts quote
the tool-call ids of earlier answers, which the engines mint differently
(the emulator's SGLang chat route repeatable ones, vLLM its own), so runs
would part after the first call. Its `tool_choice: "required"` is what
vLLM constrains with its parser's structural tag: on `vllm` each call's
constraint comes from the worker's `/v1/chat/completions/render`
(docs/engines.md#vllm).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

from tests.frameworks.harness import DemoServer, Episode, Recorder, check_episode, demo_server, dump


@pytest.fixture(scope="module", params=["sglang-chat", "vllm"])
def server(request: pytest.FixtureRequest) -> Iterator[DemoServer]:
    with demo_server("--engine", request.param, "--chat-template", "qwen3") as running:
        yield running


class Weather(Tool):  # type: ignore[misc]  # smolagents is untyped here
    name = "get_weather"
    description = "The weather in a city."
    inputs = {"city": {"type": "string", "description": "the city"}}  # noqa: RUF012
    output_type = "string"

    def forward(self, city: str) -> str:
        return f"sunny in {city}"


class Add(Tool):  # type: ignore[misc]
    name = "add"
    description = "The sum of two integers."
    inputs = {  # noqa: RUF012
        "a": {"type": "integer", "description": "first"},
        "b": {"type": "integer", "description": "second"},
    }
    output_type = "integer"

    def forward(self, a: int, b: int) -> int:
        return a + b


# (tools, max_steps, planning_interval, a follow-up task in the same memory)
EPISODES: list[tuple[list[type[Any]], int, int | None, str | None]] = [
    ([Weather, Add], 3, None, None),
    ([Add, Weather], 2, None, "Now add 2 and 3."),
    ([Weather], 4, 2, None),
]


@pytest.mark.parametrize(
    ("tools", "max_steps", "planning", "follow_up"),
    EPISODES,
    ids=["two-tools", "follow-up", "planning"],
)
def test_every_sampled_token_is_exported(
    server: DemoServer,
    episodes: list[Episode],
    tools: list[type[Any]],
    max_steps: int,
    planning: int | None,
    follow_up: str | None,
) -> None:
    recorder = Recorder()
    session_id, base_url = server.create_session({"framework": "smolagents"})
    with httpx2.Client(event_hooks={"response": [recorder.sync_hook]}) as http:
        model = OpenAIServerModel(
            model_id="rollout-session/emulator",
            api_base=base_url,
            api_key="unused",
            client_kwargs={"http_client": http, "max_retries": 0},
        )
        agent = ToolCallingAgent(
            tools=[t() for t in tools],
            model=model,
            max_steps=max_steps,
            planning_interval=planning,
            verbosity_level=-1,
        )
        agent.run("What is the weather in Paris, and what is 2 + 2?")
        if follow_up is not None:
            agent.run(follow_up, reset=False)
    doc = server.close_session(session_id)
    dump("smolagents", calls := recorder.take(), doc)
    assert all(c.status == 200 for c in calls), [c.response for c in calls if c.status != 200]
    episode = check_episode("smolagents", calls, doc)
    episodes.append(episode)
    # The history is re-formatted on every call: each call after the first
    # starts a segment (the pattern this test exists for).
    assert episode.segments > 1, server.log_tail()
