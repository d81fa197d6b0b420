"""The trainer's sampling pinned on a session, on every engine: the worker
samples with the session's values whatever the agent sends, each conflict is
counted (or refused under --on-sampling-conflict refuse), and every turn in
the export says what the engine sent (docs/api.md#pinned-sampling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.http.serving import RunningServer, start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import StackFactory, spawn_worker
from tests.loopback import TLS

USER = [{"role": "user", "content": "hello"}]
PINNED = {"temperature": 1.0, "top_p": 0.9, "seed": 11, "max_tokens": 24}
VLLM = EmulatorConfig(engine="vllm", enable_scale_out=True)

# engine -> (stack options, where the worker's request carries each key)
ENGINES: dict[str, tuple[dict[str, Any], dict[str, tuple[str, ...]]]] = {
    "sglang-chat": (
        {},
        {
            "temperature": ("temperature",),
            "top_p": ("top_p",),
            "seed": ("seed",),
            "max_tokens": ("max_tokens",),
        },
    ),
    "sglang-generate": (
        {"engine": "sglang-generate"},
        {
            "temperature": ("sampling_params", "temperature"),
            "top_p": ("sampling_params", "top_p"),
            "seed": ("sampling_params", "sampling_seed"),
            "max_tokens": ("sampling_params", "max_new_tokens"),
        },
    ),
    "vllm": (
        {"engine": "vllm", "emulator": VLLM},
        {
            "temperature": ("sampling_params", "temperature"),
            "top_p": ("sampling_params", "top_p"),
            "seed": ("sampling_params", "seed"),
            "max_tokens": ("sampling_params", "max_tokens"),
        },
    ),
}


def at(body: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        body = body[key]
    return body


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_the_worker_samples_with_the_sessions_values(
    make_stack: StackFactory, engine: str
) -> None:
    options, where = ENGINES[engine]
    stack = await make_stack(**options)
    session_id = await stack.create(sampling=PINNED)
    answered = await stack.chat(
        session_id, messages=USER, temperature=0.2, top_p=0.9, max_tokens=500
    )
    assert answered.status_code == 200, answered.text
    sent = stack.emulator.requests[-1].body
    assert {key: at(sent, path) for key, path in where.items()} == PINNED
    doc = await stack.trajectory(session_id, schema=3)
    assert doc["sampling"] == PINNED
    (turn,) = doc["segments"][0]["turns"]
    recorded = turn["sampling"]
    assert {key: recorded[key] for key in PINNED} == PINNED
    metrics = (await stack.client.get("/metrics")).text
    # The agent's temperature and max_tokens differed; its top_p did not.
    assert 'rollout_sampling_conflicts_total{action="override",param="temperature"} 1.0' in metrics
    assert 'rollout_sampling_conflicts_total{action="override",param="max_tokens"} 1.0' in metrics
    assert 'param="top_p"' not in metrics
    steps = (
        await stack.client.get(f"/sessions/{session_id}/trajectory", params={"format": "steps"})
    ).json()
    assert steps["steps"][0]["sampling"] == recorded


async def test_under_refuse_a_conflicting_turn_is_a_400_and_nothing_is_sent(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(on_sampling_conflict="refuse")
    session_id = await stack.create(sampling={"temperature": 1.0})
    refused = await stack.chat(session_id, messages=USER, temperature=0.2)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "temperature"
    assert stack.emulator.received == 0
    # The session's own value, or none, samples as usual.
    assert (await stack.chat(session_id, messages=USER)).status_code == 200


async def test_a_session_without_sampling_records_what_the_agent_sent(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack()
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER, temperature=0.2)).status_code == 200
    doc = await stack.trajectory(session_id, schema=3)
    assert doc["sampling"] is None
    recorded = doc["segments"][0]["turns"][0]["sampling"]
    # The chat route's own defaults apply to what the agent left unset.
    assert recorded["temperature"] == 0.2 and recorded["top_p"] is None


@pytest.mark.parametrize(
    "sampling", [{"temperature": "hot"}, {"logit_bias": {}}], ids=["bad-value", "unknown-key"]
)
async def test_a_bad_sampling_is_refused_at_creation(
    make_stack: StackFactory, sampling: dict[str, Any]
) -> None:
    stack = await make_stack()
    refused = await stack.client.post("/sessions", json={"sampling": sampling})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"].startswith("sampling.")


async def test_the_sessions_sampling_and_its_turns_survive_a_restart(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    tmp_path: Path,
) -> None:
    worker = await spawn_worker(nursery, text_model, EmulatorConfig())
    settings = Settings(workers=(worker.url,), journal=str(tmp_path), engine="sglang-chat", port=0)

    async def document(server: RunningServer, session_id: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
            doc: dict[str, Any] = (await client.get(f"/sessions/{session_id}/trajectory")).json()
        return doc

    app = create_app(settings, tokenizer=chat_tokenizers["chatml"], worker_tls=TLS)
    server = await start_server(nursery, app)
    async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
        session_id = (await client.post("/sessions", json={"sampling": PINNED})).json()[
            "session_id"
        ]
        path = f"/sessions/{session_id}/v1/chat/completions"
        assert (await client.post(path, json={"messages": USER})).status_code == 200
    before = await document(server, session_id)
    await server.aclose()
    app = create_app(settings, tokenizer=chat_tokenizers["chatml"], worker_tls=TLS)
    server = await start_server(nursery, app)
    after = await document(server, session_id)
    assert after["sampling"] == before["sampling"] == PINNED
    assert after["segments"][0]["turns"] == before["segments"][0]["turns"]
    await server.aclose()
