"""The checks themselves (harness.check_episode, check_same_across_engines),
with the official SDK sending the requests the frameworks send: a retry is
accounted as the server replaces it, a server that loses sampled tokens
fails the check, and so does an engine that samples or parses otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from tests.frameworks.harness import (
    ENGINES,
    DemoServer,
    ModelCall,
    Recorder,
    check_episode,
    check_same_across_engines,
    demo_server,
    demo_servers,
)

MODEL = "rollout-session/emulator"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, DemoServer]]:
    with demo_servers() as running:
        yield running


@pytest.fixture(scope="module")
def server(servers: dict[str, DemoServer]) -> DemoServer:
    return servers[ENGINES[0]]


@pytest.fixture(scope="module")
def rollback_server() -> Iterator[DemoServer]:
    """The strict policy that drops the turns a divergent request leaves out."""
    with demo_server("--on-divergence", "rollback", "--max-rollback-turns", "8") as running:
        yield running


def _episode(server: DemoServer, dropped_answer: bool) -> tuple[list[ModelCall], dict[str, Any]]:
    """Three user turns with a tool; the second is sent twice (a client
    retry); with `dropped_answer`, the third leaves out the answer before it."""
    recorder = Recorder()
    session_id, base_url = server.create_session()
    with httpx2.Client(event_hooks={"response": [recorder.sync_hook]}) as http:
        client = openai.OpenAI(base_url=base_url, api_key="unused", http_client=http)
        messages: list[Any] = [{"role": "user", "content": "Read a.txt"}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        call = answer.choices[0].message.tool_calls
        assert call
        messages += [
            answer.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call[0].id, "content": "hello"},
        ]
        for _ in range(2):  # the answer of the first try is lost: a retry
            answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        if not dropped_answer:
            messages.append(answer.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "And b.txt?"})
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    return recorder.take(), server.close_session(session_id)


@pytest.mark.parametrize("dropped_answer", [False, True], ids=["linear", "dropped-answer"])
def test_a_retry_is_accounted(server: DemoServer, dropped_answer: bool) -> None:
    calls, doc = _episode(server, dropped_answer)
    episode = check_episode("openai", calls, doc)
    assert (episode.ok_calls, episode.retries, episode.turns) == (4, 1, 3)
    assert episode.rollbacks == {"retry": 1}
    assert episode.segments == (2 if dropped_answer else 1)


def test_a_lost_answer_fails_the_check(rollback_server: DemoServer) -> None:
    calls, doc = _episode(rollback_server, dropped_answer=True)
    with pytest.raises(AssertionError, match="turns exported"):
        check_episode("openai", calls, doc)


def test_the_engines_are_compared(servers: dict[str, DemoServer]) -> None:
    """The same episode under each engine: the same answers and export; a
    logprob or a tool call that differs fails the comparison."""
    runs = {engine: _episode(server, dropped_answer=False) for engine, server in servers.items()}
    assert check_same_across_engines("openai", runs) == 4
    chat, generate = (runs[engine] for engine in ENGINES[:2])
    doc = copy.deepcopy(generate[1])
    doc["segments"][0]["logprobs"][-1] -= 0.5
    with pytest.raises(AssertionError, match="segment 0 logprobs differs"):
        check_same_across_engines("openai", {"a": chat, "b": (generate[0], doc)})
    calls = copy.deepcopy(generate[0])
    assert calls[0].response is not None
    calls[0].response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] = "other"
    with pytest.raises(AssertionError, match="call 0 answered differently"):
        check_same_across_engines("openai", {"a": chat, "b": (calls, generate[1])})


def _streamed_turns(base_url: str, protocol: str) -> None:
    """Two streamed turns, the answer sent back as the agent read it."""
    questions = ["Read a.txt", "And b.txt?"]
    if protocol == "messages":
        with anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused") as ac:
            history: list[Any] = []
            for question in questions:
                history.append({"role": "user", "content": question})
                with ac.messages.stream(model=MODEL, max_tokens=64, messages=history) as events:
                    message = events.get_final_message()
                content = [b.model_dump(exclude_none=True) for b in message.content]
                history.append({"role": "assistant", "content": content})
        return
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        items: list[Any] = []
        for question in questions:
            items.append({"role": "user", "content": question})
            if protocol == "responses":
                with client.responses.stream(model=MODEL, input=items) as stream:
                    response = stream.get_final_response()
                items += [item.model_dump(exclude_none=True) for item in response.output]
                continue
            chunks = client.chat.completions.create(
                model=MODEL, messages=items, stream=True, stream_options={"include_usage": True}
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            items.append({"role": "assistant", "content": text})


PROTOCOLS = ["chat", "responses", "messages"]


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=PROTOCOLS)
def test_a_streamed_answer_is_checked_by_count_and_text(server: DemoServer, protocol: str) -> None:
    """A streamed answer carries no ids: the recorder reads it back from its
    events, and the check compares its token count and text."""
    recorder = Recorder()
    session_id, base_url = server.create_session()
    with recorder.every_client():
        _streamed_turns(base_url, protocol)
    calls = recorder.take()
    assert [c.protocol for c in calls] == [protocol, protocol]
    assert all(c.sampled is None and c.text for c in calls)
    episode = check_episode(f"{protocol} streamed", calls, server.close_session(session_id))
    assert (episode.turns, episode.segments) == (2, 1)
