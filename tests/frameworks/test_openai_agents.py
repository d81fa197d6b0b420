"""The OpenAI Agents SDK (chat-completions mode) on a reasoning model
(`--demo-reasoning --chat-template qwen3`) against `serve --demo`.

What the SDK does to the history: it keeps the run as Responses-style items
and converts them back to chat messages for every call. Reasoning comes back
as a `reasoning` item that is not re-sent (the assistant message goes back
without `reasoning_content`); an answer with reasoning and no text or tool
call converts to no message at all, so the next request leaves it out. A
handoff switches the system prompt and the tools (a new segment,
`tools_changed`); with `nest_handoff_history` the history is also collapsed
into one summary message. A `Session` with `SessionSettings(limit=…)` and a
`call_model_input_filter` cut old items from the front.

Each episode runs under every engine (`--engine sglang-chat`,
`sglang-generate` and `vllm`): the same answers and the same trajectory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from agents import (
    Agent,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    SQLiteSession,
    function_tool,
    set_tracing_disabled,
)
from agents.memory import SessionSettings
from agents.run_config import CallModelData, ModelInputData

from tests.frameworks.harness import (
    ENGINES,
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
    set_tracing_disabled(True)
    with demo_servers("--demo-reasoning", "--chat-template", "qwen3") as running:
        yield running


@pytest.fixture(scope="module")
def server(servers: dict[str, DemoServer]) -> DemoServer:
    return servers[ENGINES[0]]


def _weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def _add(a: int, b: int) -> int:
    """The sum of two integers."""
    return a + b


get_weather = function_tool(_weather, name_override="get_weather")
add = function_tool(_add, name_override="add")


def _recent_only(data: CallModelData[Any]) -> ModelInputData:
    """A context budget: the first item and the last two."""
    items = data.model_data.input
    kept = items[:1] + items[-2:] if len(items) > 4 else items
    return ModelInputData(input=kept, instructions=data.model_data.instructions)


def _agents(model: OpenAIChatCompletionsModel, kind: str) -> Agent[Any]:
    if kind.startswith("handoff"):
        math = Agent(name="math", instructions="You do arithmetic.", tools=[add], model=model)
        return Agent(name="triage", instructions="You route.", handoffs=[math], model=model)
    # A budget the model's thinking does not fit in: every answer is cut
    # inside its think block, reasoning only.
    settings = ModelSettings(max_tokens=6) if kind == "thinking-cut" else ModelSettings()
    return Agent(
        name="helper",
        instructions="You help.",
        tools=[get_weather, add],
        model=model,
        model_settings=settings,
    )


def _run_config(kind: str) -> RunConfig:
    if kind == "handoff-nested":
        return RunConfig(nest_handoff_history=True)
    if kind == "session-limit":
        return RunConfig(session_settings=SessionSettings(limit=4))
    if kind == "input-filter":
        return RunConfig(call_model_input_filter=_recent_only)
    return RunConfig()


async def _episode(base_url: str, recorder: Recorder, kind: str, questions: int) -> None:
    async with httpx2.AsyncClient(event_hooks={"response": [recorder.async_hook]}) as http:
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", http_client=http, max_retries=0
        )
        start = _agents(OpenAIChatCompletionsModel(model=MODEL, openai_client=client), kind)
        config = _run_config(kind)
        session = SQLiteSession(f"episode-{kind}") if kind == "session-limit" else None
        history: list[Any] = []
        # The same question each run: after a failed run the next one sends
        # the same request again.
        question = "The weather in Paris, and 2 + 2?"
        for _ in range(questions):
            if session is not None:
                await Runner.run(start, question, session=session, run_config=config)
                continue
            try:
                result = await Runner.run(
                    start, [*history, {"role": "user", "content": question}], run_config=config
                )
            except ModelBehaviorError:
                # A reasoning-only answer cut by max_tokens ends the run: the
                # next one sends the same request again.
                assert kind == "thinking-cut"
                continue
            history = result.to_input_list()


KINDS = [
    "multi-run",
    "thinking-cut",
    "handoff",
    "handoff-nested",
    "session-limit",
    "input-filter",
]


def _checked_episode(
    server: DemoServer, engine: str, kind: str
) -> tuple[list[ModelCall], dict[str, Any], Episode]:
    recorder = Recorder()
    session_id, base_url = server.create_session(
        {"framework": "openai-agents", "kind": kind, "engine": engine}
    )
    asyncio.run(_episode(base_url, recorder, kind, questions=3))
    doc = server.close_session(session_id)
    calls = recorder.take()
    dump(f"openai-agents-{engine}", calls, doc)
    assert all(c.status == 200 for c in calls), [c.response for c in calls if c.status != 200]
    return calls, doc, check_episode(f"openai-agents ({kind}, {engine})", calls, doc)


def _check_shape(server: DemoServer, kind: str, episode: Episode) -> None:
    assert episode.ok_calls >= (3 if kind == "thinking-cut" else 6)
    if kind == "multi-run":
        # Reasoning is not re-sent and is not needed: the runs extend one segment.
        assert episode.segments == 1, server.log_tail()
    elif kind == "thinking-cut":
        # The same request after a reasoning-only answer: not a retry (the
        # agent saw the answer), a new segment that keeps the answer before.
        assert episode.reasons == {"answer_dropped": episode.ok_calls - 1}, server.log_tail()
        assert episode.retries == 0
    else:
        assert episode.segments > 1, server.log_tail()


@pytest.mark.parametrize("kind", KINDS, ids=KINDS)
def test_every_sampled_token_is_exported(
    servers: dict[str, DemoServer], episodes: list[Episode], kind: str
) -> None:
    runs: dict[str, tuple[list[ModelCall], dict[str, Any]]] = {}
    for engine, server in servers.items():
        calls, doc, episode = _checked_episode(server, engine, kind)
        episodes.append(episode)
        runs[engine] = calls, doc
        _check_shape(server, kind, episode)
    assert check_same_across_engines(f"openai-agents ({kind})", runs) >= 1


def test_the_default_mode_speaks_the_responses_api(server: DemoServer) -> None:
    """The SDK's default model (Responses) runs a tool-using agent to the
    end: every model call is one turn, and its output tokens are the
    export's sampled tokens. (The Responses answer carries no token ids, so
    the check is by count, not by id.)"""
    from agents import OpenAIResponsesModel

    answers: list[dict[str, Any]] = []

    async def record(response: Any) -> None:
        await response.aread()
        if str(response.request.url).endswith("/responses"):
            assert response.status_code == 200, response.content[:300]
            answers.append(response.json())

    async def run(base_url: str) -> None:
        async with httpx2.AsyncClient(event_hooks={"response": [record]}) as http:
            client = openai.AsyncOpenAI(
                base_url=base_url, api_key="unused", http_client=http, max_retries=0
            )
            agent = Agent(
                name="helper",
                instructions="You help.",
                tools=[get_weather, add],
                model=OpenAIResponsesModel(model=MODEL, openai_client=client),
            )
            history: list[Any] = []
            for _ in range(2):
                result = await Runner.run(
                    agent, [*history, {"role": "user", "content": "The weather in Paris?"}]
                )
                history = result.to_input_list()

    session_id, base_url = server.create_session(
        {"framework": "openai-agents", "kind": "responses"}
    )
    asyncio.run(run(base_url))
    doc = server.close_session(session_id)
    turns = sum(len(s["turns"]) for s in doc["segments"])
    sampled = sum(sum(s["loss_mask"]) for s in doc["segments"])
    dropped = sum(r["dropped_tokens"] for r in doc["rollbacks"])
    assert len(answers) >= 2
    assert turns + sum(r["dropped_turns"] for r in doc["rollbacks"]) == len(answers)
    assert sampled + dropped == sum(a["usage"]["output_tokens"] for a in answers)
