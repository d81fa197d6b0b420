"""Shared fixtures: a real emulator and a real session server on loopback.

Both load the bundled test tokenizer once per test run (it is read-only), and
every test gets its own emulator + server pair on free ports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
import openai
import pytest
import trio
from hypothesis import HealthCheck, settings
from transformers import AutoTokenizer

from rollout_session import Settings, create_app
from rollout_session.emulator import (
    Emulator,
    EmulatorConfig,
    TextModel,
    builtin_template,
    bundled_tokenizer_path,
    start_emulator,
)
from rollout_session.http.app import server_context
from rollout_session.http.context import ServerContext
from rollout_session.http.serving import RunningServer, start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.loopback import TLS

# Property-test budgets: "ci" (the suite's) and "long" (`scripts/fuzz`). Here,
# not in a test module: `--hypothesis-profile` is applied when pytest is
# configured, after conftest files load and before test modules do.
settings.register_profile(
    "ci", max_examples=240, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile(
    "long", max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.load_profile("ci")


def agent_turn(base_url: str, api_key: str = "unused", content: str = "hello") -> str:
    """One turn as an agent's official SDK takes it (synchronous: run it on a thread)."""
    client = openai.OpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=TLS),
    )
    try:
        answer = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": content}]
        )
        return answer.choices[0].message.content or ""
    finally:
        client.close()


TOOLS = [
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
# Tools other than TOOLS: a request changing to them diverges (tools_changed).
OTHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="session")
def hf_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(bundled_tokenizer_path()))


@pytest.fixture(scope="session")
def chat_tokenizers(hf_tokenizer: Any) -> dict[str, ChatTokenizer]:
    return {
        name: ChatTokenizer(hf_tokenizer, builtin_template(name)) for name in ("chatml", "qwen3")
    }


@dataclass
class Worker:
    """An emulator worker that a test can kill abruptly (like a crashed process)
    and start again on the same port."""

    server: RunningServer
    emulator: Emulator
    scope: trio.CancelScope

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        self.scope.cancel()


# The SGLang parsers a worker serving each bundled template is launched with
# (SGLang's names; its chat route parses tool calls and reasoning only with
# them): Qwen's <tool_call> JSON for both, Qwen3's <think> blocks.
SGLANG_PARSERS: dict[str, dict[str, Any]] = {
    "chatml": {"tool_call_parser": "qwen25"},
    "qwen3": {"tool_call_parser": "qwen25", "reasoning_parser": "qwen3"},
}


def with_template_parsers(config: EmulatorConfig) -> EmulatorConfig:
    """``config`` as a trainer launches an SGLang worker for its template: a
    bundled template's SGLang parsers (`SGLANG_PARSERS`; no template is the
    bundled tokenizer's ChatML) unless the config names a parser. Other
    templates and vLLM workers are left as they are (family tests name their
    family's parsers: `tests.families.sglang_parsers`)."""
    if config.engine != "sglang" or config.tool_call_parser or config.reasoning_parser:
        return config
    template = config.chat_template
    if template is None and config.tokenizer_path == bundled_tokenizer_path():
        template = builtin_template("chatml")
    name = next((n for n in SGLANG_PARSERS if builtin_template(n) == template), None)
    return config if name is None else replace(config, **SGLANG_PARSERS[name])


async def spawn_worker(
    nursery: trio.Nursery,
    model: TextModel,
    config: EmulatorConfig,
    port: int = 0,
    *,
    parsers: bool = True,
) -> Worker:
    """An emulator worker; an SGLang one with its template's parsers
    (`with_template_parsers`) unless ``parsers`` is false."""
    if parsers:
        config = with_template_parsers(config)

    async def host(task_status: trio.TaskStatus[Worker]) -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as inner:
                server, emulator = await start_emulator(inner, config, model=model, port=port)
                task_status.started(Worker(server, emulator, scope))

    worker: Worker = await nursery.start(host)
    return worker


@dataclass
class Stack:
    """Emulator workers behind one session server."""

    url: str
    ctx: ServerContext
    workers: list[Worker]
    client: httpx.AsyncClient
    server: RunningServer

    @property
    def emulator(self) -> Emulator:
        return self.workers[0].emulator

    @property
    def emulator_server(self) -> RunningServer:
        return self.workers[0].server

    @property
    def emulator_url(self) -> str:
        return self.workers[0].url

    async def create(self, **body: Any) -> str:
        response = await self.client.post("/sessions", json=body)
        assert response.status_code == 201, response.text
        session_id: str = response.json()["session_id"]
        return session_id

    async def chat(self, session_id: str, **body: Any) -> httpx.Response:
        return await self.client.post(f"/sessions/{session_id}/v1/chat/completions", json=body)

    async def trajectory(self, session_id: str, schema: int = 1) -> dict[str, Any]:
        """The export document. Schema 1 by default (v1's: the last
        segment's fields at the top level), what most tests read: their
        sessions have one segment; ``schema=3`` for every segment."""
        response = await self.client.get(
            f"/sessions/{session_id}/trajectory", params={"schema": schema}
        )
        assert response.status_code == 200, response.text
        doc: dict[str, Any] = response.json()
        return doc


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture(scope="session")
def text_model(hf_tokenizer: Any) -> TextModel:
    return TextModel(hf_tokenizer)


@pytest.fixture
async def make_stack(
    nursery: trio.Nursery, text_model: TextModel, chat_tokenizers: dict[str, ChatTokenizer]
) -> AsyncIterator[StackFactory]:
    clients: list[httpx.AsyncClient] = []
    servers: list[RunningServer] = []

    async def factory(
        *,
        template: str = "chatml",
        emulator: EmulatorConfig | None = None,
        num_workers: int = 1,
        **settings: Any,
    ) -> Stack:
        # The workers' model speaks the template the server renders with.
        template_text = chat_tokenizers[template].chat_template
        workers = [
            await spawn_worker(
                nursery,
                text_model,
                replace(
                    emulator or EmulatorConfig(seed=i),
                    chat_template=(emulator.chat_template if emulator else None) or template_text,
                ),
            )
            for i in range(num_workers)
        ]
        # The chat route unless a test names its engine: most tests check what
        # sglang-chat sends and answers (the engines' own tests name theirs).
        settings.setdefault("engine", "sglang-chat")
        app_settings = Settings(workers=tuple(w.url for w in workers), port=0, **settings)
        app = create_app(app_settings, tokenizer=chat_tokenizers[template], worker_tls=TLS)
        server = await start_server(nursery, app, max_connections=app_settings.max_connections)
        servers.append(server)
        key = settings.get("api_key")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        client = httpx.AsyncClient(base_url=server.url, timeout=30, headers=headers, verify=TLS)
        clients.append(client)
        return Stack(server.url, server_context(app), workers, client, server)

    yield factory
    for client in clients:
        await client.aclose()
    # Graceful: the app's after_serving closes its worker clients. Workers go
    # with the test's nursery.
    for server in servers:
        await server.aclose()


@pytest.fixture
async def stack(make_stack: StackFactory) -> Stack:
    return await make_stack()
