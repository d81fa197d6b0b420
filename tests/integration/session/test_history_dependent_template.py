"""A template whose appended messages depend on the history, end to end.

Command-R7B's tool-use template numbers tool calls across the whole
conversation, and a tool result names its call by that number: the second
tool result says ``"tool_call_id": "1"``. Rendered after a synthetic
context (token-in/token-out's junction), it would say ``"0"``. The start-up
check finds this and says so, and the server renders such a template's
turns whole where they need it (docs/templates.md#history-dependent-templates):
the worker reads, turn after turn, exactly the template's rendering of the
request, or the turn starts a new segment (or is refused), never a prompt
no render holds.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio
from transformers import AutoTokenizer

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.http.serving import RunningServer, start_server
from rollout_session.prompt.messages import normalize_messages
from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer
from tests.conftest import Worker, spawn_worker
from tests.families import model_path
from tests.integration.session.test_families import WEATHER
from tests.integration.session.test_turns import answered, check_document
from tests.loopback import TLS

Serve = Callable[[str], Awaitable[tuple[str, Worker, ChatTokenizer]]]


@pytest.fixture
async def serve_command_r7b(nursery: trio.Nursery) -> AsyncIterator[Serve]:
    servers: list[RunningServer] = []

    async def start(on_divergence: str) -> tuple[str, Worker, ChatTokenizer]:
        path = model_path("command-r7b")
        model = TextModel(AutoTokenizer.from_pretrained(str(path)))
        # The worker parses Cohere's actions into tool calls (the emulator's
        # parsers are the template's own).
        config = EmulatorConfig(tokenizer_path=path, tool_call_parser="cohere_command4")
        worker = await spawn_worker(nursery, model, config)
        settings = Settings(
            workers=(worker.url,),
            port=0,
            tokenizer=str(path),
            engine="sglang-chat",
            on_divergence=on_divergence,
        )
        tok = load_tokenizer(path)
        server = await start_server(nursery, create_app(settings, tokenizer=tok, worker_tls=TLS))
        servers.append(server)
        return server.url, worker, tok

    yield start
    for server in servers:
        await server.aclose()


@pytest.mark.parametrize("on_divergence", ["segment", "error"], ids=["segment", "error"])
async def test_each_turn_reads_the_full_render_of_its_conversation(
    serve_command_r7b: Serve, on_divergence: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two tool rounds, a text answer, a new user message and a third call:
    every prompt the worker read is the template's rendering of that
    request. The session stays one segment while the template renders its
    history as it was sampled; the emulator's model numbers its third call
    "0" (it reads only its prompt's last exchange) where the template writes
    "2", so the turn after it cannot continue the session: it starts a new
    segment, rendered from scratch, or, under ``--on-divergence error``, is
    refused with the reason, instead of sending a tool result the
    template would not write after that history."""
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        url, worker, tok = await serve_command_r7b(on_divergence)
    # Start-up says how it serves the template, and what that costs.
    [warning] = [r.getMessage() for r in caplog.records if "rendered whole" in r.getMessage()]
    assert warning.startswith(
        "the chat template renders appended messages from the history (tool call, parallel "
        "tool calls): it is served rendered whole"
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Weather in Paris, then Rome?"},
    ]
    # The tool choice per turn ("none": a text answer, the markers of
    # Cohere's response skipped as special tokens), then what the agent appends.
    choices = ["required", "required", "none", "required", "none"]
    async with httpx.AsyncClient(base_url=url, timeout=30, verify=TLS) as client:
        sid = (await client.post("/sessions", json={})).json()["session_id"]
        for turn, choice in enumerate(choices):
            body = {"messages": messages, "tools": [WEATHER], "tool_choice": choice, "seed": turn}
            response = await client.post(f"/sessions/{sid}/v1/chat/completions", json=body)
            if turn == 4 and on_divergence == "error":
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["code"] == "trajectory_diverged"
                assert "so the turn is rendered whole" in error["message"]
                break
            assert response.status_code == 200, response.text
            sent = worker.emulator.requests[-1].body["input_ids"]
            full = tok.first_turn(normalize_messages(messages), tools=[WEATHER], kwargs={})
            assert sent == full, f"turn {turn + 1}"
            if turn == 2:  # the second tool result, named by its number
                assert '"tool_call_id": "1"' in tok.decode(sent)
            message = response.json()["choices"][0]["message"]
            assert bool(message.get("tool_calls")) is (choice == "required")
            messages += answered(message, f"weather {turn}")
            if not message.get("tool_calls"):
                messages.append({"role": "user", "content": "And in Oslo?"})
        doc = (await client.get(f"/sessions/{sid}/trajectory")).json()
    segments = [len(s["turns"]) for s in doc["segments"]]
    assert segments == ([4, 1] if on_divergence == "segment" else [4])
    if on_divergence == "segment":
        assert doc["segments"][1]["branch"]["reason"] == "rendered_differently"
    for segment in doc["segments"]:
        check_document(segment)
