"""`--engine auto` (the default) against emulator workers: each worker served
by the token route of its family, what the workers say about themselves read
at start-up, and a fleet that disagrees refused with the reason
(`engines/resolve.py`, docs/engines.md#engine-auto)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.engines.resolve import resolve_engine
from rollout_session.http.app import server_context
from rollout_session.http.serving import start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import Worker, spawn_worker
from tests.loopback import TLS

USER = [{"role": "user", "content": "Hello"}]
VLLM = {"engine": "vllm", "enable_scale_out": True}


async def resolve(*urls: str, **settings: Any) -> Any:
    chosen = Settings(workers=urls, port=0, **settings)
    return await resolve_engine(
        chosen, chosen.workers, tls=TLS, deadline_s=5.0, connect_timeout_s=2.0
    )


async def workers(
    nursery: trio.Nursery, text_model: TextModel, *configs: EmulatorConfig
) -> list[Worker]:
    return [await spawn_worker(nursery, text_model, config) for config in configs]


@pytest.mark.parametrize(
    ("emulator", "engine"),
    [({}, "sglang-generate"), (VLLM, "vllm")],
    ids=["sglang-worker", "vllm-worker"],
)
async def test_each_family_is_served_by_its_token_route(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    emulator: dict[str, Any],
    engine: str,
) -> None:
    template = chat_tokenizers["chatml"]
    (worker,) = await workers(
        nursery, text_model, EmulatorConfig(chat_template=template.chat_template, **emulator)
    )
    app = create_app(Settings(workers=(worker.url,), port=0), tokenizer=template, worker_tls=TLS)
    server = await start_server(nursery, app)
    ctx = server_context(app)
    assert ctx.side.spec.name == engine and ctx.side.settings.engine == engine
    before = worker.emulator.received  # the start-up's and admission's probes
    async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
        session_id = (await client.post("/sessions")).json()["session_id"]
        path = f"/sessions/{session_id}/v1/chat/completions"
        answered = await client.post(path, json={"messages": USER})
        assert answered.status_code == 200, answered.text
    assert worker.emulator.received == before + 1
    await server.aclose()


async def test_workers_of_two_families_are_refused(
    nursery: trio.Nursery, text_model: TextModel
) -> None:
    sglang, vllm = await workers(
        nursery, text_model, EmulatorConfig(), EmulatorConfig(engine="vllm", enable_scale_out=True)
    )
    with pytest.raises(ValueError, match="two kinds") as refused:
        await resolve(sglang.url, vllm.url)
    assert sglang.url in str(refused.value) and vllm.url in str(refused.value)


async def test_workers_of_two_models_are_refused(
    nursery: trio.Nursery, text_model: TextModel
) -> None:
    one, other = await workers(
        nursery, text_model, EmulatorConfig(), EmulatorConfig(model_name="other/model")
    )
    with pytest.raises(ValueError, match="different models") as refused:
        await resolve(one.url, other.url)
    assert "other/model" in str(refused.value)


async def test_a_vllm_worker_without_its_token_route_is_refused_naming_the_flag(
    nursery: trio.Nursery, text_model: TextModel
) -> None:
    (worker,) = await workers(nursery, text_model, EmulatorConfig(engine="vllm"))
    with pytest.raises(ValueError, match="start vLLM with --enable-scale-out"):
        await resolve(worker.url)


async def test_a_worker_that_does_not_answer_is_left_to_its_pool(
    nursery: trio.Nursery, text_model: TextModel
) -> None:
    """One answering worker is enough to choose; the others join when they
    answer (the pool's admission checks them the same way)."""
    (worker,) = await workers(nursery, text_model, EmulatorConfig())
    chosen = await resolve(worker.url, "http://127.0.0.1:9")
    assert chosen.spec.name == "sglang-generate"
    with pytest.raises(ValueError, match="no worker answered"):
        await resolve("http://127.0.0.1:9")
    # A named engine starts with its flags as given.
    assert (await resolve("http://127.0.0.1:9", engine="sglang-chat")).spec.name == "sglang-chat"
