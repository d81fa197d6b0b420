"""Every listed model family end to end: the genuine template, a tokenizer
with the family's markers as single tokens, the emulator speaking the
family's format, the official `openai` SDK as the agent over real HTTP.

Per turn: the prompt equals the template's rendering of that request where
`check-template` says the family is exact, and otherwise its appended part
is exactly the template's tail, joined to the sampled ids the way the check
accepts (never a duplicated, missing or foreign token); the sampled ids are
the worker's, under mask 1, and nothing else is. A family served rendered
whole (history-dependent: docs/templates.md#history-dependent-templates)
starts a segment where its render cannot continue the session; each
segment's first prompt is the template's rendering of its request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import trio

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig
from rollout_session.emulator.model.prompt_reader import ALL_TOOLS
from rollout_session.http.serving import RunningServer, start_server
from rollout_session.prompt.check import Outcome, junction_problem
from rollout_session.prompt.junction import STOPPED
from rollout_session.prompt.messages import Message, assistant_message, normalize_messages
from rollout_session.prompt.model_output import CallIds
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import spawn_worker
from tests.families import (
    family_path,
    family_text_model,
    family_tokenizer,
    sglang_parsers,
    template_text,
)
from tests.integration.session.test_turns import check_document
from tests.loopback import TLS
from tests.unit.prompt.test_check import CASES, REPORT

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@dataclass
class Turn:
    request: list[Message]  # the request's messages, normalised as the server stores them
    sampled: list[int]  # the worker's sampled ids
    answer: Message  # the answer as the server stores it


@dataclass
class Episode:
    tools: list[Any] | None
    turns: list[Turn] = field(default_factory=list)


Serve = Callable[[str, dict[str, Any]], Awaitable[str]]


@pytest.fixture
async def serve_family(nursery: trio.Nursery) -> AsyncIterator[Serve]:
    servers: list[RunningServer] = []

    async def start(family: str, kwargs: dict[str, Any]) -> str:
        path = family_path(family)
        model = family_text_model(family)
        # The worker runs the family's SGLang parsers (its chat route parses only with them).
        config = EmulatorConfig(tokenizer_path=path, reasoning=True, **sglang_parsers(family))
        worker = await spawn_worker(nursery, model, config)
        settings = Settings(
            workers=(worker.url,),
            port=0,
            tokenizer=str(path),
            chat_template_kwargs=kwargs,
            engine="sglang-chat",  # the token route's parity is test_generate_parity's
        )
        server = await start_server(
            nursery, create_app(settings, tokenizer=family_tokenizer(family), worker_tls=TLS)
        )
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        await server.aclose()


def _echo(message: Any) -> dict[str, Any]:
    """The answer as an agent appends it: OpenAI's fields, reasoning dropped."""
    data: dict[str, Any] = message.model_dump(exclude_none=True)
    out: dict[str, Any] = {"role": "assistant", "content": data.get("content")}
    if data.get("tool_calls"):
        out["tool_calls"] = [
            {k: c[k] for k in ("id", "type", "function")} for c in data["tool_calls"]
        ]
    return out


async def _episode(
    agent: openai.AsyncOpenAI,
    *,
    tools: list[Any] | None,
    cut_at: int | None = None,
    parallel: bool = False,
    lists_tools: bool = True,
    **extra: Any,
) -> Episode:
    """System + user, then four model calls: tool results after tool calls,
    a new user message after text; `cut_at` gets max_tokens=3. The emulator's
    model reads its prompt (docs/emulator.md#the-model-reads-its-prompt):
    `parallel` asks it for every tool at once; a template that does not
    render tools (`lists_tools` false) gets them in the system prompt."""
    system = "You are a helpful agent."
    if tools and not lists_tools:
        # The template writes no tools (DeepSeek's): list them, as its users do.
        system += "\nTools:\n" + "\n".join(json.dumps(t) for t in tools)
    ask = "What is the weather in Paris?" + (f" Please {ALL_TOOLS}." if parallel else "")
    messages: list[Any] = [
        {"role": "system", "content": system},
        {"role": "user", "content": ask},
    ]
    episode = Episode(tools)
    for i in range(4):
        options: dict[str, Any] = {"tools": tools} if tools else {}
        response = await agent.chat.completions.create(
            model="any",
            messages=messages,
            max_tokens=3 if i == cut_at else 64,
            seed=i,
            extra_body=extra or None,
            **options,
        )
        choice = response.choices[0]
        fields = choice.model_extra or {}
        # SGLang's answers carry meta_info; the vllm engine's, vLLM's token_ids.
        sampled = (
            [entry[1] for entry in fields["meta_info"]["output_token_logprobs"]]
            if "meta_info" in fields
            else fields["token_ids"]
        )
        message = choice.message
        calls = [c.model_dump() for c in message.tool_calls or []]
        reasoning = (message.model_extra or {}).get("reasoning_content")
        episode.turns.append(
            Turn(
                normalize_messages(messages),
                sampled,
                assistant_message(message.content, calls, reasoning),
            )
        )
        messages.append(_echo(message))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"done {i}"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": f"Tell me more, part {i}."})
    return episode


def _check_turns(
    tok: ChatTokenizer,
    doc: dict[str, Any],
    episode: Episode,
    kwargs: dict[str, Any],
    exact: bool,
) -> None:
    """Every segment of the export `doc` (schema 3) against the episode's turns."""
    assert sum(len(s["turns"]) for s in doc["segments"]) == len(episode.turns)
    first = 0
    for segment in doc["segments"]:
        check_document(segment)
        turns = Episode(episode.tools, episode.turns[first : first + len(segment["turns"])])
        _check_segment(tok, segment, turns, kwargs, exact)
        first += len(segment["turns"])


def _check_segment(
    tok: ChatTokenizer,
    doc: dict[str, Any],
    episode: Episode,
    kwargs: dict[str, Any],
    exact: bool,
) -> None:
    ids: list[int] = doc["token_ids"]
    assert len(doc["turns"]) == len(episode.turns)
    spans: list[tuple[int, int, str]] = []
    for k, (record, turn) in enumerate(zip(doc["turns"], episode.turns, strict=True)):
        start, middle, end = (
            record["prompt_start"],
            record["completion_start"],
            record["completion_end"],
        )
        # (b) the worker's sampled ids, exactly, under mask 1 (check_document: only there).
        assert ids[middle:end] == turn.sampled
        spans += [(start, middle, f"prompt {k}"), (middle, end, f"answer {k}")]
        reference = tok.first_turn(turn.request, tools=episode.tools, kwargs=kwargs)
        server = ids[:middle]
        if k == 0 or exact:
            assert server == reference, f"turn {k + 1}"
            continue
        previous = episode.turns[k - 1]
        previous_record = doc["turns"][k - 1]
        new = turn.request[len(previous.request) + 1 :]
        junction = tok.junction(previous.answer, new, tools=episode.tools, kwargs=kwargs)
        # (a, c) the appended ids are the template's tail, joined as the check accepts.
        stopped = previous_record["finish_reason"] in STOPPED
        problem = junction_problem(
            tok, ids[start - 1], ids[start:middle], junction, stopped, server, reference, spans
        )
        assert problem is None or problem[0] is Outcome.REWRITES, (f"turn {k + 1}", problem)
        # ... and the template's own after this history, not only after the
        # junction's synthetic context (history-dependent templates).
        assert tok.appends_alike(
            previous.request, previous.answer, new, tools=episode.tools, kwargs=kwargs
        ), f"turn {k + 1}"


def calls_written(tok: ChatTokenizer) -> int:
    """How many of an answer's two tool calls the template writes: the
    emulator's model calls no more than that (harmony writes one per answer;
    DeepSeek-R1's template none, as it writes calls only for a null content,
    which stored messages never have)."""
    ids = CallIds(tok)
    calls = [
        {"id": ids(i), "type": "function", "function": {"name": name, "arguments": {}}}
        for i, name in enumerate(("probe_a", "probe_b"))
    ]
    text = tok.render(
        [
            {"role": "user", "content": "."},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ],
        tools=None,
        kwargs={},
        add_generation_prompt=False,
    )
    return sum(name in text for name in ("probe_a", "probe_b"))


# Families whose template shows an answer's reasoning (with these kwargs).
REASONING = {"qwen3", "deepseek-r1", "glm-4.6", "gpt-oss"}
# (family, server kwargs, whether answers carry reasoning)
CONFIGS = [
    *((family, {}, family in REASONING) for family in REPORT),
    ("deepseek-v3.1", {"thinking": True}, True),
    ("qwen3", {"enable_thinking": False}, False),
]
PATTERNS = ["plain", "tool call", "parallel tool calls", "cut by max_tokens"]


@pytest.mark.parametrize(
    ("family", "kwargs", "reasoning"),
    CONFIGS,
    ids=[f"{f}{'-' + str(k) if k else ''}" for f, k, _ in CONFIGS],
)
async def test_family_episodes_are_exact(
    serve_family: Serve, family: str, kwargs: dict[str, Any], reasoning: bool
) -> None:
    url = await serve_family(family, kwargs)
    tok = family_tokenizer(family)
    outcomes = dict(zip(CASES, REPORT[family], strict=True))
    whole = Outcome.HISTORY_DEPENDENT in outcomes.values()
    lists_tools = "tools" in template_text(family)
    async with httpx.AsyncClient(base_url=url, timeout=30, verify=TLS) as trainer:
        for pattern in PATTERNS:
            if outcomes[pattern] is Outcome.UNSUPPORTED:
                continue  # the template refuses it (check-template names why)
            sid = (await trainer.post("/sessions", json={})).json()["session_id"]
            agent = openai.AsyncOpenAI(
                base_url=f"{url}/sessions/{sid}/v1",
                api_key="unused",
                max_retries=0,
                http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
            )
            if pattern == "plain":
                episode = await _episode(agent, tools=None)
                # Reasoning models answer with reasoning the template shows.
                reasoned = [bool(t.answer.get("reasoning_content")) for t in episode.turns]
                assert all(reasoned) is reasoning and any(reasoned) is reasoning
            elif pattern == "tool call":
                episode = await _episode(agent, tools=[WEATHER], lists_tools=lists_tools)
            elif pattern == "parallel tool calls":
                episode = await _episode(
                    agent,
                    tools=[WEATHER, CLOCK],
                    parallel=True,
                    lists_tools=lists_tools,
                    parallel_tool_calls=True,
                )
                most = max(len(t.answer.get("tool_calls") or []) for t in episode.turns)
                assert most == calls_written(tok)
            else:
                episode = await _episode(agent, tools=None, cut_at=1)
                assert len(episode.turns[1].sampled) == 3
            await agent.close()
            doc = (await trainer.get(f"/sessions/{sid}/trajectory")).json()
            # Only a template served rendered whole starts segments in these episodes.
            assert len(doc["segments"]) == 1 or whole, [s["branch"] for s in doc["segments"]]
            # Reasoning answers are exact where the check's reasoning case is.
            any_reasoning = any(t.answer.get("reasoning_content") for t in episode.turns)
            exact = (
                not kwargs
                and outcomes[pattern] is Outcome.EXACT
                and (not any_reasoning or outcomes["reasoning"] is Outcome.EXACT)
            )
            _check_turns(tok, doc, episode, {**kwargs}, exact)


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        # Llama prints `date_string` in the system header: a diff that ignored
        # the request's kwargs would see every session as mismatched.
        ("llama-3.1", {"chat_template_kwargs": {"date_string": "01 Jan 2030"}}),
        # Stored tool calls have dict arguments; DeepSeek concatenates strings.
        ("deepseek-v3.1", {}),
    ],
)
async def test_diff_renders_like_the_turns_did(
    serve_family: Serve, family: str, extra: dict[str, Any]
) -> None:
    url = await serve_family(family, {})
    async with httpx.AsyncClient(base_url=url, timeout=30, verify=TLS) as trainer:
        sid = (await trainer.post("/sessions", json={})).json()["session_id"]
        agent = openai.AsyncOpenAI(
            base_url=f"{url}/sessions/{sid}/v1",
            api_key="unused",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(verify=TLS),
        )
        lists_tools = "tools" in template_text(family)
        episode = await _episode(agent, tools=[WEATHER], lists_tools=lists_tools, **extra)
        await agent.close()
        assert any(t.answer["tool_calls"] for t in episode.turns)
        response = await trainer.get(f"/sessions/{sid}/diff")
        assert response.status_code == 200, response.text
        diff = response.json()
        assert diff["first_mismatch"] is None and diff["tail_expected"] is True
