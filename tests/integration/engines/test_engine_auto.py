"""`--engine auto` (the default) against emulator workers: each worker served
by the token route of its family, what the workers say about themselves read
at start-up, and a fleet that disagrees refused with the reason
(`engines/resolve.py`, docs/engines.md#engine-auto)."""

from __future__ import annotations

import logging
import re
from dataclasses import replace
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
from tests.conftest import TOOLS, StackFactory, Worker, spawn_worker
from tests.integration.session.test_turns import run_tool_episode
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
    with pytest.raises(ValueError, match="no worker can serve"):
        await resolve("http://127.0.0.1:9")
    # A named engine starts with its flags as given.
    assert (await resolve("http://127.0.0.1:9", engine="sglang-chat")).spec.name == "sglang-chat"


async def test_the_parsers_are_read_from_the_workers(make_stack: StackFactory) -> None:
    """The workers run ChatML's parsers (`qwen25`, which SGLang runs, and
    publishes, as `qwen`); no flag names them here, and tool calls parse."""
    stack = await make_stack(engine="auto")
    side = stack.ctx.side
    assert side.spec.name == "sglang-generate"
    assert (side.settings.tool_call_parser, side.settings.reasoning_parser) == ("qwen", None)
    session_id = await stack.create()
    _, answers = await run_tool_episode(stack, session_id, turns=2)
    assert answers[0]["choices"][0]["message"]["tool_calls"]
    assert "<tool_call>" not in answers[0]["choices"][0]["message"]["content"]


async def test_a_flag_must_agree_with_the_workers(
    nursery: trio.Nursery, text_model: TextModel
) -> None:
    (worker,) = await workers(nursery, text_model, EmulatorConfig(tool_call_parser="qwen25"))
    with pytest.raises(ValueError) as refused:
        await resolve(worker.url, tool_call_parser="hermes")
    assert str(refused.value) == (
        "the workers run --tool-call-parser qwen, but --tool-call-parser hermes was given "
        "here: start the server without it (the workers' own is taken), or the workers with it"
    )
    # SGLang's old name of the same parser agrees.
    chosen = await resolve(worker.url, tool_call_parser="qwen25")
    assert chosen.settings.tool_call_parser == "qwen"
    # sglang-chat takes no parser flag; one that repeats the workers' is refused
    # all the same when named, since the chat route parses with the worker's.
    with pytest.raises(ValueError, match="leave this server's unset"):
        await resolve(worker.url, engine="sglang-chat", tool_call_parser="qwen")


async def test_workers_that_parse_differently_are_refused(
    nursery: trio.Nursery, text_model: TextModel
) -> None:
    one, other = await workers(
        nursery,
        text_model,
        EmulatorConfig(tool_call_parser="qwen25"),
        EmulatorConfig(tool_call_parser="hermes"),
    )
    for engine in ("auto", "sglang-chat"):
        with pytest.raises(ValueError) as refused:
            await resolve(one.url, other.url, engine=engine)
        assert str(refused.value) == (
            f"the workers disagree: {one.url} runs --tool-call-parser qwen, {other.url} runs "
            "--tool-call-parser hermes; every worker of a server runs the same"
        )


@pytest.mark.parametrize("engine", ["auto", "sglang-chat"])
async def test_a_joining_worker_that_parses_differently_is_refused(
    make_stack: StackFactory, nursery: trio.Nursery, text_model: TextModel, engine: str
) -> None:
    stack = await make_stack(engine=engine)
    other = await spawn_worker(nursery, text_model, EmulatorConfig(tool_call_parser="hermes"))
    refused = await stack.client.post("/workers", json={"url": other.url})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "url"
    assert (
        "runs --tool-call-parser hermes, where this server expects --tool-call-parser qwen"
        in error["message"]
    )
    assert not stack.ctx.pool.knows(other.url)


async def test_workers_launched_without_parsers_take_this_servers(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """verl launches SGLang without parsers: `sglang-generate` parses with the
    flag's (its parse routes take the name per request); without a flag
    the start warns that tool calls will be text."""
    template = chat_tokenizers["chatml"]
    bare = EmulatorConfig(chat_template=template.chat_template)
    worker = await spawn_worker(nursery, text_model, bare, parsers=False)
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        unparsed = await resolve(worker.url)
    assert unparsed.settings.tool_call_parser is None
    assert "no tool-call parser, so tool calls reach agents as text" in caplog.text
    settings = Settings(workers=(worker.url,), port=0, tool_call_parser="qwen25")
    app = create_app(settings, tokenizer=template, worker_tls=TLS)
    server = await start_server(nursery, app)
    assert server_context(app).side.settings.tool_call_parser == "qwen"
    async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
        session_id = (await client.post("/sessions")).json()["session_id"]
        path = f"/sessions/{session_id}/v1/chat/completions"
        answered = await client.post(path, json={"messages": USER, "tools": TOOLS})
        assert answered.status_code == 200, answered.text
        assert answered.json()["choices"][0]["message"]["tool_calls"]
    # A worker with a parser joins such a pool only with the same one.
    hermes = await spawn_worker(nursery, text_model, replace(bare, tool_call_parser="hermes"))
    async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
        refused = await client.post("/workers", json={"url": hermes.url})
        assert refused.status_code == 400, refused.text
        qwen = await spawn_worker(nursery, text_model, replace(bare, tool_call_parser="qwen25"))
        joined = await client.post("/workers", json={"url": qwen.url})
        assert joined.status_code == 201, joined.text
    await server.aclose()


async def test_sglang_chat_needs_a_worker_with_a_tokenizer(
    nursery: trio.Nursery, text_model: TextModel
) -> None:
    (worker,) = await workers(nursery, text_model, EmulatorConfig(skip_tokenizer_init=True))
    with pytest.raises(ValueError) as refused:
        await resolve(worker.url, engine="sglang-chat")
    assert str(refused.value) == (
        "--engine sglang-chat needs workers with no --skip-tokenizer-init; "
        "they run with --skip-tokenizer-init"
    )
    chosen = await resolve(worker.url)
    assert chosen.spec.name == "sglang-generate" and chosen.launch["skip_tokenizer_init"] is True


OVERRIDE = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}


async def test_a_vllm_workers_generation_config_override_is_adopted_and_recorded(
    make_stack: StackFactory,
) -> None:
    """verl launches vLLM with `override_generation_config`: the chat route
    samples with it, so the engine does too, and every turn records it."""
    emulator = EmulatorConfig(
        engine="vllm",
        enable_scale_out=True,
        tool_call_parser="hermes",
        override_generation_config=OVERRIDE,
    )
    stack = await make_stack(emulator=emulator, engine="auto", tool_call_parser="hermes")
    assert stack.ctx.side.spec.name == "vllm"
    session_id = await stack.create()
    answered = await stack.chat(session_id, messages=USER)
    assert answered.status_code == 200, answered.text
    sent = stack.emulator.requests[-1].body
    assert {k: sent["sampling_params"][k] for k in OVERRIDE} == OVERRIDE
    (turn,) = (await stack.trajectory(session_id))["turns"]
    assert {k: turn["sampling"][k] for k in OVERRIDE} == OVERRIDE
    # The agent's own value wins over a default, as on vLLM's chat route.
    answered = await stack.chat(session_id, messages=USER, temperature=0.2)
    assert answered.status_code == 200, answered.text
    assert (await stack.trajectory(session_id))["turns"][-1]["sampling"]["temperature"] == 0.2


async def test_vllm_workers_with_different_defaults_are_refused(
    nursery: trio.Nursery, text_model: TextModel
) -> None:
    vllm = EmulatorConfig(engine="vllm", enable_scale_out=True, tool_call_parser="hermes")
    one, other = await workers(
        nursery, text_model, vllm, replace(vllm, override_generation_config=OVERRIDE)
    )
    with pytest.raises(ValueError, match="the workers disagree") as refused:
        await resolve(one.url, other.url, tool_call_parser="hermes")
    assert one.url in str(refused.value) and other.url in str(refused.value)


@pytest.mark.parametrize(
    ("worker_parser", "flag", "refusal"),
    [
        (
            None,
            "hermes",
            "--tool-call-parser hermes was given here, but the workers parse no tool calls",
        ),
        ("hermes", None, "the workers parse tool calls (--enable-auto-tool-choice), but no"),
        # llama3_json leaves special tokens skipped on tool requests; hermes does not.
        ("llama3_json", "hermes", "the workers run other parsers than these flags name"),
    ],
    ids=["flag-without-worker-parser", "worker-parser-without-flag", "another-parser"],
)
async def test_vllm_parser_flags_are_checked_against_the_workers_rendering(
    nursery: trio.Nursery,
    text_model: TextModel,
    worker_parser: str | None,
    flag: str | None,
    refusal: str,
) -> None:
    """vLLM does not publish its parsers; its rendering of a tool request
    shows whether it parses tool calls and what its parser does to the
    request, and a flag that contradicts that is refused."""
    vllm = EmulatorConfig(engine="vllm", enable_scale_out=True, tool_call_parser=worker_parser)
    (worker,) = await workers(nursery, text_model, vllm)
    for engine in ("auto", "vllm"):
        with pytest.raises(ValueError, match=re.escape(refusal)):
            await resolve(worker.url, engine=engine, tool_call_parser=flag)
    if worker_parser is not None:
        chosen = await resolve(worker.url, tool_call_parser=worker_parser)
        assert chosen.launch["tool_parsing"] is True
