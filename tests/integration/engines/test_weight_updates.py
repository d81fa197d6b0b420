"""Weight updates mid-turn, end to end: a session server in front of
emulator workers that model SGLang 0.5.23's and vLLM 0.33's aborts, pauses
and version labels (rollout_session/emulator/weights.py).

An interrupted turn is continued from prompt + partial ids (sglang-generate,
vllm) or sampled afresh (sglang-chat); either way the agent gets the answer
an uninterrupted turn gives (the emulator's model continues its own answer
token for token), never an ``abort``, and every sampled token names the
policy that sampled it. The reference is the same turn in a fresh session
of the same stack, sampled without interruption.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from rollout_session import Settings, create_app
from rollout_session.client import SessionClient
from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.emulator.worker import Emulator
from rollout_session.engines.vllm.parsers import VllmParsers
from rollout_session.http.app import server_context
from rollout_session.http.serving import start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import TOOLS, Stack, StackFactory, spawn_worker
from tests.families import (
    FAMILIES,
    family_facts,
    family_path,
    family_text_model,
    family_tokenizer,
    template_text,
)
from tests.integration.session.test_families import WEATHER
from tests.loopback import TLS
from tests.stalls import in_flight_midway, stalled, until

READ = [{"role": "user", "content": "Read the file notes.txt, please."}]
THINK = [{"role": "user", "content": "Think it through, then answer at length."}]
# Slow enough to interrupt midway: a reasoning answer takes about half a second.
TIMING: dict[str, Any] = {"decode_s_per_token": 0.004, "completion_tokens": 120}


@dataclass(frozen=True)
class Engine:
    emulator: EmulatorConfig
    server: dict[str, Any]
    continues: bool  # False: the turn is sampled afresh (sglang-chat)


ENGINES = {
    "sglang-chat": Engine(EmulatorConfig(), {}, continues=False),
    "sglang-generate": Engine(
        EmulatorConfig(),
        {"engine": "sglang-generate", "tool_call_parser": "qwen25", "reasoning_parser": "qwen3"},
        continues=True,
    ),
    "vllm": Engine(
        EmulatorConfig(
            engine="vllm",
            enable_scale_out=True,
            tool_call_parser="hermes",
            reasoning_parser="qwen3",
            enable_prompt_tokens_details=True,
        ),
        {"engine": "vllm", "tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
        continues=True,
    ),
}

# What the interrupted part of the answer is: the agent's request, and the
# text the cut must fall inside.
SPLITS: dict[str, tuple[list[dict[str, Any]], list[Any] | None, str]] = {
    "inside-a-tool-call": (READ, TOOLS, "<tool_call>"),
    "inside-think": (THINK, None, "<think>"),
}


async def make(
    make_stack: StackFactory,
    engine: Engine,
    *,
    decode_s: float = 0.004,
    completion_tokens: int = 120,
    **settings: Any,
) -> Stack:
    config = EmulatorConfig(
        **{
            **engine.emulator.__dict__,
            "completion_tokens": completion_tokens,
            "decode_s_per_token": decode_s,
            "reasoning": True,
            "weight_version": "v1",
            "seed": 7,
        }
    )
    return await make_stack(template="qwen3", emulator=config, **engine.server, **settings)


def update_weights(emulator: Emulator, version: str, *, abort: bool) -> None:
    """The trainer's update at the worker: SGLang's /update_weight_version
    (aborting what runs, when asked), vLLM's /pause (abort) + label + /resume."""
    weights = emulator.weights
    if emulator.config.engine == "vllm":
        if abort:
            weights.abort(weights.runs(), "pause")
        weights.vllm_update_weight_version(version)
    else:
        weights.sglang_update_weight_version(version, abort_all=abort)


def message_shape(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls") or []
    return {
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning_content"),
        "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
    }


async def reference(stack: Stack, messages: list[Any], tools: list[Any] | None) -> Any:
    """The same turn, uninterrupted, in a fresh session."""
    sid = await stack.create()
    answer = await stack.chat(sid, messages=messages, tools=tools, seed=3)
    assert answer.status_code == 200, answer.text
    doc = await stack.trajectory(sid)
    return answer.json(), doc


def turn_ids(doc: dict[str, Any], index: int = 0) -> list[int]:
    turn = doc["turns"][index]
    ids: list[int] = doc["token_ids"][turn["completion_start"] : turn["completion_end"]]
    return ids


def check_spans(turn: dict[str, Any]) -> list[str | None]:
    spans = turn["weight_versions"]
    at = turn["completion_start"]
    for span in spans:
        assert span["start"] == at < span["end"]
        at = span["end"]
    assert at == turn["completion_end"]
    return [s["version"] for s in spans]


async def interrupted_turn(
    stack: Stack,
    messages: list[Any],
    tools: list[Any] | None,
    interrupt: Callable[[], Awaitable[None]],
    at_least: int,
    **body: Any,
) -> httpx.Response:
    sid = await stack.create(session_id="interrupted")
    answers: list[httpx.Response] = []

    async def agent() -> None:
        answers.append(await stack.chat(sid, messages=messages, tools=tools, seed=3, **body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent)
        async with stalled(stack.emulator, lambda: in_flight_midway(stack.emulator, at_least)):
            await interrupt()
    return answers[0]


def cut_position(
    doc: dict[str, Any], tokenizer_decode: Callable[[list[int]], str], marker: str
) -> int:
    """Where, in the reference answer, the text `marker` starts (in tokens)."""
    ids = turn_ids(doc)
    for i in range(len(ids)):
        if marker in tokenizer_decode(ids[: i + 1]):
            return i
    raise AssertionError(f"{marker!r} not in the reference answer")


@pytest.mark.parametrize("split", SPLITS, ids=list(SPLITS))
@pytest.mark.parametrize("name", ENGINES, ids=list(ENGINES))
async def test_a_weight_update_under_an_abort_pause_loses_no_work(
    make_stack: StackFactory, name: str, split: str
) -> None:
    """The trainer's sync: pause in abort mode mid-turn, update the worker's
    weights, resume declaring the version. The agent gets the uninterrupted
    answer; the turn's tokens name both policies (or, on sglang-chat, the
    new one, the partial discarded)."""
    engine = ENGINES[name]
    stack = await make(make_stack, engine)
    messages, tools, marker = SPLITS[split]
    expected, ref_doc = await reference(stack, messages, tools)
    assert stack.ctx.turns is not None
    decode = stack.ctx.turns.tokenizer.decode
    inside = cut_position(ref_doc, decode, marker) + 3
    paused: list[dict[str, Any]] = []

    async def sync() -> None:
        paused.append((await stack.client.post("/admin/pause", json={"mode": "abort"})).json())
        update_weights(stack.emulator, "v2", abort=False)
        resumed = await stack.client.post("/admin/resume", json={"weight_version": "v2"})
        assert resumed.json() == {"paused": False, "weight_version": "v2"}

    answer = await interrupted_turn(stack, messages, tools, sync, inside)
    assert answer.status_code == 200, answer.text
    assert paused[0]["interrupted"] == 1 and paused[0]["mode"] == "abort"
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] != "abort"
    assert choice["finish_reason"] == expected["choices"][0]["finish_reason"]
    assert message_shape(choice["message"]) == message_shape(expected["choices"][0]["message"])
    doc = await stack.trajectory("interrupted")
    assert turn_ids(doc) == turn_ids(ref_doc)
    (turn,) = doc["turns"]
    (continuation,) = turn["continuations"]
    if engine.continues:
        assert check_spans(turn) == ["v1", "v2"]
        cut = turn["weight_versions"][1]["start"]
        assert continuation["start"] == cut and continuation["discarded_tokens"] == 0
        assert cut - turn["completion_start"] >= inside  # the cut is inside the marked part
        # The continuation sent the prompt and the partial, whole.
        assert continuation["prompt_tokens"] == cut
        # Old-policy tokens kept their logprobs; new-policy ones are the new model's.
        ref_lps = ref_doc["logprobs"][turn["completion_start"] : cut]
        assert doc["logprobs"][turn["completion_start"] : cut] == ref_lps
    else:
        assert check_spans(turn) == ["v2"]
        assert continuation["start"] == turn["completion_start"]
        assert continuation["discarded_tokens"] >= inside
    assert continuation["worker"] == stack.emulator_url


@pytest.mark.parametrize("name", ["sglang-generate", "vllm"], ids=["sglang-generate", "vllm"])
async def test_an_update_the_trainer_starts_at_the_worker_is_continued_at_once(
    make_stack: StackFactory, name: str
) -> None:
    """SGLang's /update_weight_version (abort_all_requests defaults to true)
    or vLLM's abort pause, while the session server is not paused: the
    turn goes on at once, its versions from the worker's labels."""
    stack = await make(make_stack, ENGINES[name])
    expected, ref_doc = await reference(stack, THINK, None)

    async def update() -> None:
        update_weights(stack.emulator, "v2", abort=True)

    answer = await interrupted_turn(stack, THINK, None, update, 20)
    assert answer.status_code == 200, answer.text
    assert message_shape(answer.json()["choices"][0]["message"]) == message_shape(
        expected["choices"][0]["message"]
    )
    doc = await stack.trajectory("interrupted")
    assert turn_ids(doc) == turn_ids(ref_doc)
    assert check_spans(doc["turns"][0]) == ["v1", "v2"]
    metrics = (await stack.client.get("/metrics")).text
    assert 'rollout_turns_interrupted_total{action="continued"} 1.0' in metrics
    # The aborted answer was not parsed (it is continued, never answered):
    # one parse per answered turn, the reference's and the stitched one's.
    if name == "vllm":
        assert sum(r.route == "vllm-derender" for r in stack.emulator.requests) == 1
    else:
        assert stack.emulator.parse_calls["separate_reasoning"] == 2


@pytest.mark.parametrize("mode", ["in_place", "retract"], ids=["in_place", "retract"])
@pytest.mark.parametrize("name", ["sglang-chat", "sglang-generate"], ids=["chat", "generate"])
async def test_a_request_kept_inside_the_worker_records_both_policies(
    make_stack: StackFactory, name: str, mode: str
) -> None:
    """SGLang's pause modes that keep requests inside the worker: nothing is
    aborted, and the answer's meta_info.weight_versions says which tokens
    each version sampled (utils/weight_versions.py): recorded as reported."""
    stack = await make(make_stack, ENGINES[name])
    weights = stack.emulator.weights

    async def update() -> None:
        await weights.sglang_pause(mode)
        weights.sglang_update_weight_version("v2", abort_all=False)
        weights.sglang_continue()

    answer = await interrupted_turn(stack, THINK, None, update, 10)
    assert answer.status_code == 200, answer.text
    (turn,) = (await stack.trajectory("interrupted"))["turns"]
    assert turn["continuations"] == []
    assert check_spans(turn) == ["v1", "v2"]
    assert turn["weight_version"] == "v2"


async def test_a_streaming_agent_gets_one_stream_of_the_whole_answer(
    make_stack: StackFactory,
) -> None:
    """The SDK's streaming agent (sync, in a thread, as in test_sdk): one
    stream, one finish, the tool call whole although the cut fell inside it."""
    stack = await make(make_stack, ENGINES["sglang-generate"])
    expected, _ = await reference(stack, READ, TOOLS)
    sid = await stack.create(session_id="interrupted")

    def stream() -> list[Any]:
        with openai.OpenAI(
            base_url=f"{stack.url}/sessions/{sid}/v1",
            api_key="x",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=TLS),
        ) as agent:
            request: dict[str, Any] = {"model": "m", "messages": READ, "tools": TOOLS, "seed": 3}
            events = agent.chat.completions.create(stream=True, **request)
            with events:
                return list(events)

    chunks: list[Any] = []

    async def agent() -> None:
        chunks.extend(await trio.to_thread.run_sync(stream))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent)
        async with stalled(stack.emulator, lambda: in_flight_midway(stack.emulator, 10)):
            await stack.client.post("/admin/pause", json={"mode": "abort"})
        await stack.client.post("/admin/resume")
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [expected["choices"][0]["finish_reason"]]
    calls = [
        (d.function.name, d.function.arguments)
        for c in chunks
        if c.choices
        for d in c.choices[0].delta.tool_calls or []
        if d.function is not None
    ]
    (want,) = expected["choices"][0]["message"]["tool_calls"]
    assert "".join(a or "" for _, a in calls) == want["function"]["arguments"]
    assert [n for n, _ in calls if n] == [want["function"]["name"]]
    (turn,) = (await stack.trajectory(sid))["turns"]
    assert len(turn["continuations"]) == 1


@pytest.mark.parametrize("when", ["waiting", "continuing"], ids=["waiting", "continuing"])
async def test_a_continuation_fails_over_when_the_worker_is_gone(
    make_stack: StackFactory, when: str
) -> None:
    """The session's worker dies while the turn waits for resume, or while
    it samples the continuation: the continuation goes to the other worker
    (same model), which continues the same answer."""
    engine = ENGINES["sglang-generate"]
    stack = await make(make_stack, engine, num_workers=2)
    expected, ref_doc = await reference(stack, THINK, None)
    sid = await stack.create(session_id="interrupted")
    answers: list[httpx.Response] = []

    async def agent() -> None:
        answers.append(await stack.chat(sid, messages=THINK, seed=3))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent)
        await until(lambda: any(w.emulator.weights.runs() for w in stack.workers))
        (first,) = [w.emulator for w in stack.workers if w.emulator.weights.runs()]
        async with stalled(first, lambda: in_flight_midway(first, 10)):
            await stack.client.post("/admin/pause", json={"mode": "abort"})
        await until(lambda: stack.ctx.pause.waiting == 1)
        pinned = stack.ctx.registry.get(sid).worker
        (dead,) = [w for w in stack.workers if w.url == pinned]
        if when == "continuing":
            await stack.client.post("/admin/resume")
            await until(lambda: in_flight_midway(dead.emulator, 1))
        dead.kill()
        await stack.client.post("/admin/resume")
    assert answers[0].status_code == 200, answers[0].text
    doc = await stack.trajectory(sid)
    assert turn_ids(doc) == turn_ids(ref_doc)
    (turn,) = doc["turns"]
    assert turn["worker"] == pinned
    (continuation,) = turn["continuations"]
    assert continuation["worker"] != pinned and continuation["discarded_tokens"] == 0
    assert message_shape(answers[0].json()["choices"][0]["message"]) == message_shape(
        expected["choices"][0]["message"]
    )


async def test_an_abort_pause_interrupts_64_turns_and_all_continue(
    make_stack: StackFactory,
) -> None:
    stack = await make(make_stack, ENGINES["sglang-generate"])
    emulator = stack.emulator
    ids = [await stack.create() for _ in range(64)]
    answers: dict[str, httpx.Response] = {}

    async def agent(sid: str) -> None:
        answers[sid] = await stack.chat(sid, messages=THINK, seed=3)

    def every_turn_mid_answer() -> bool:
        # Decoding, short of the last token but one: SGLang's abort runs one
        # more step, and an answer it completes is sampled afresh instead.
        runs = emulator.weights.runs()
        return len(runs) == 64 and all(
            run.progress.phase == "decode"
            and emulator.gpu.decoded(run.progress) < run.progress.total - 1
            for run in runs
        )

    async with trio.open_nursery() as nursery:
        # The GPU stalled until every turn has arrived: they decode together,
        # none finishes before the last one has started, however loaded the
        # machine.
        emulator.gpu.freeze()
        for sid in ids:
            nursery.start_soon(agent, sid)
        await until(lambda: len(emulator.weights.runs()) == 64)
        emulator.gpu.thaw()
        async with stalled(emulator, every_turn_mid_answer):
            paused = (await stack.client.post("/admin/pause", json={"mode": "abort"})).json()
        assert paused["interrupted"] == 64
        await until(lambda: stack.ctx.pause.waiting == 64)
        update_weights(emulator, "v2", abort=False)
        # Through the trainer's client, as a trainer would.
        async with SessionClient([stack.url]) as client:
            assert await client.resume("v2") == [{"paused": False, "weight_version": "v2"}]
    assert all(a.status_code == 200 for a in answers.values())
    for sid in ids:
        (turn,) = (await stack.trajectory(sid))["turns"]
        assert turn["finish_reason"] != "abort"
        assert check_spans(turn)[-1] == "v2"
        assert len(turn["continuations"]) == 1
    metrics = (await stack.client.get("/metrics")).text
    assert 'rollout_turns_interrupted_total{action="continued"} 64.0' in metrics
    assert "rollout_reprefilled_tokens_total" in metrics


async def test_an_abort_after_the_last_token_samples_the_turn_afresh(
    make_stack: StackFactory,
) -> None:
    """SGLang's abort runs one more decode step: when that step samples the
    end-of-turn token, the aborted answer is whole. Its continuation would
    follow an end of turn: the turn is sampled afresh instead, and the agent
    still gets the uninterrupted answer."""
    stack = await make(make_stack, ENGINES["sglang-generate"], decode_s=0.03, completion_tokens=40)
    expected, ref_doc = await reference(stack, THINK, None)
    emulator = stack.emulator

    def at_the_last_token() -> bool:
        return any(
            emulator.gpu.decoded(run.progress) == run.progress.total - 1
            for run in emulator.weights.runs()
        )

    sid = await stack.create(session_id="interrupted")
    answers: list[httpx.Response] = []

    async def agent() -> None:
        answers.append(await stack.chat(sid, messages=THINK, seed=3))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent)
        async with stalled(emulator, at_the_last_token):
            await stack.client.post("/admin/pause", json={"mode": "abort"})
        await stack.client.post("/admin/resume")
    assert answers[0].status_code == 200, answers[0].text
    assert message_shape(answers[0].json()["choices"][0]["message"]) == message_shape(
        expected["choices"][0]["message"]
    )
    doc = await stack.trajectory(sid)
    assert turn_ids(doc) == turn_ids(ref_doc)
    (continuation,) = doc["turns"][0]["continuations"]
    assert continuation["discarded_tokens"] == len(turn_ids(ref_doc))
    assert continuation["start"] == doc["turns"][0]["completion_start"]


async def test_on_abort_return_hands_the_abort_to_the_agent(make_stack: StackFactory) -> None:
    stack = await make(make_stack, ENGINES["sglang-generate"], on_abort="return")

    async def pause() -> None:
        await stack.client.post("/admin/pause", json={"mode": "abort"})

    answer = await interrupted_turn(stack, THINK, None, pause, 10)
    await stack.client.post("/admin/resume")
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["finish_reason"] == "abort"
    (turn,) = (await stack.trajectory("interrupted"))["turns"]
    assert turn["finish_reason"] == "abort" and turn["continuations"] == []


async def test_delete_while_the_turn_waits_to_continue(make_stack: StackFactory) -> None:
    stack = await make(make_stack, ENGINES["sglang-generate"])
    sid = await stack.create(session_id="interrupted")
    answers: list[httpx.Response] = []

    async def agent() -> None:
        answers.append(await stack.chat(sid, messages=THINK, seed=3))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent)
        async with stalled(stack.emulator, lambda: in_flight_midway(stack.emulator, 10)):
            await stack.client.post("/admin/pause", json={"mode": "abort"})
        await until(lambda: stack.ctx.pause.waiting == 1)
        closed = await stack.client.delete(f"/sessions/{sid}", params={"schema": 1})
        assert closed.status_code == 200 and closed.json()["turns"] == []
    assert answers[0].status_code == 404
    assert answers[0].json()["error"]["code"] == "session_closing"
    assert stack.ctx.pause.waiting == 0
    await stack.client.post("/admin/resume")
    assert stack.emulator.received == 1  # never continued


async def test_past_max_continuations_the_turn_fails_and_commits_nothing(
    make_stack: StackFactory,
) -> None:
    """A worker that aborts every answer (the emulator's abort fault)."""
    stack = await make_stack(emulator=EmulatorConfig(fault="abort"), max_continuations=2)
    sid = await stack.create()
    answer = await stack.chat(sid, messages=THINK)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "turn_interrupted"
    assert "retry-after" in answer.headers
    assert (await stack.trajectory(sid))["turns"] == []
    assert stack.emulator.received == 3  # the first request and two continuations


# -- every family of the families suite ------------------------------------------------

WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _family_configs(family: str) -> dict[str, tuple[EmulatorConfig, dict[str, Any]]]:
    """The continuing engines this family is served by: (worker, server settings)."""
    facts = family_facts(family)
    path = family_path(family)
    out: dict[str, tuple[EmulatorConfig, dict[str, Any]]] = {}
    tool, reasoning = facts.get("sglang_tool_call_parser"), facts.get("sglang_reasoning_parser")
    if tool is not None and reasoning != "gpt-oss":
        out["sglang-generate"] = (
            EmulatorConfig(tokenizer_path=path),
            {"engine": "sglang-generate", "tool_call_parser": tool, "reasoning_parser": reasoning},
        )
    tool, reasoning = facts["vllm_tool_call_parser"], facts["vllm_reasoning_parser"]
    try:
        VllmParsers(tool, reasoning)
    except ValueError:
        tool = None
    if tool is not None:
        out["vllm"] = (
            EmulatorConfig(
                tokenizer_path=path,
                engine="vllm",
                enable_scale_out=True,
                tool_call_parser=tool,
                reasoning_parser=reasoning,
            ),
            {"engine": "vllm", "tool_call_parser": tool, "reasoning_parser": reasoning},
        )
    return out


FAMILY_CASES = [
    (family, engine)
    for family in FAMILIES
    if "tools" in template_text(family)
    for engine in _family_configs(family)
]


@pytest.mark.parametrize(
    ("family", "engine"), FAMILY_CASES, ids=[f"{f}-{e}" for f, e in FAMILY_CASES]
)
async def test_every_family_continues_a_tool_call_cut_in_half(
    nursery: trio.Nursery, family: str, engine: str
) -> None:
    """The family's genuine template and tokenizer, its parsers on the
    worker: a tool-call answer cut halfway by an abort pause is answered as
    the uninterrupted one is, token for token."""
    worker_config, settings = _family_configs(family)[engine]
    config = replace(worker_config, reasoning=True, weight_version="v1", **TIMING)
    worker = await spawn_worker(nursery, family_text_model(family), config)
    app = create_app(
        Settings(workers=(worker.url,), port=0, tokenizer=str(family_path(family)), **settings),
        tokenizer=family_tokenizer(family),
        worker_tls=TLS,
    )
    server = await start_server(nursery, app)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
            body = {"messages": WEATHER_ASK, "tools": [WEATHER], "seed": 3}

            async def turn(sid: str) -> httpx.Response:
                await client.post("/sessions", json={"session_id": sid})
                return await client.post(f"/sessions/{sid}/v1/chat/completions", json=body)

            expected = await turn("reference")
            assert expected.status_code == 200, expected.text
            answers: list[httpx.Response] = []

            async def agent() -> None:
                answers.append(await turn("interrupted"))

            async with trio.open_nursery() as inner:
                inner.start_soon(agent)
                emulator = worker.emulator

                def past_the_middle() -> bool:
                    return any(
                        run.progress.total // 2
                        <= emulator.gpu.decoded(run.progress)
                        < run.progress.total
                        for run in emulator.weights.runs()
                    )

                async with stalled(emulator, past_the_middle):
                    await client.post("/admin/pause", json={"mode": "abort"})
                update_weights(worker.emulator, "v2", abort=False)
                await client.post("/admin/resume")
            assert answers[0].status_code == 200, answers[0].text
            got, want = answers[0].json(), expected.json()
            assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
            assert message_shape(got["choices"][0]["message"]) == message_shape(
                want["choices"][0]["message"]
            )
            docs = [
                (await client.get(f"/sessions/{sid}/trajectory", params={"schema": 1})).json()
                for sid in ("reference", "interrupted")
            ]
            assert turn_ids(docs[1]) == turn_ids(docs[0])
            (interrupted,) = docs[1]["turns"]
            (continuation,) = interrupted["continuations"]
            vllm_parser = (
                VllmParsers(settings["tool_call_parser"], None).tool if engine == "vllm" else None
            )
            if vllm_parser is not None and vllm_parser.function_level:
                # vLLM constrains every tool request of this parser with a
                # grammar: sampled afresh, the partial dropped.
                assert continuation["discarded_tokens"] > 0
                assert check_spans(interrupted) == ["v2"]
            else:
                assert continuation["discarded_tokens"] == 0
                assert check_spans(interrupted) == ["v1", "v2"]
    finally:
        await server.aclose()


async def test_a_restart_while_a_turn_waits_commits_no_partial_answer(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    tmp_path: Path,
) -> None:
    """A turn waiting to continue was never committed: the server going
    away (graceful: its grace ends, the turn is cancelled) leaves the
    journal with the session as it was before that turn, and the restarted
    server has nothing of it — never a committed partial answer."""
    config = replace(ENGINES["sglang-generate"].emulator, reasoning=True, **TIMING)
    worker = await spawn_worker(nursery, text_model, replace(config, chat_template=None))
    settings = Settings(
        workers=(worker.url,),
        port=0,
        journal=str(tmp_path),
        journal_fsync="always",
        **ENGINES["sglang-generate"].server,
    )
    app = create_app(settings, tokenizer=chat_tokenizers["chatml"], worker_tls=TLS)
    # The shutdown grace (--shutdown-grace-s, as `serve` passes it).
    server = await start_server(nursery, app, graceful_timeout=0.5)
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
        await client.post("/sessions", json={"session_id": "waiting"})

        async def agent() -> None:
            with contextlib.suppress(httpx.HTTPError):
                answers.append(
                    await client.post(
                        "/sessions/waiting/v1/chat/completions", json={"messages": THINK}
                    )
                )

        async with trio.open_nursery() as inner:
            inner.start_soon(agent)
            async with stalled(worker.emulator, lambda: in_flight_midway(worker.emulator, 10)):
                await client.post("/admin/pause", json={"mode": "abort"})
            await until(lambda: server_context(app).pause.waiting == 1)
            await server.aclose()  # graceful: the waiting turn is cancelled at the grace's end
    assert not answers or answers[0].status_code != 200
    restarted = create_app(settings, tokenizer=chat_tokenizers["chatml"], worker_tls=TLS)
    server = await start_server(nursery, restarted)
    async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
        doc = (await client.get("/sessions/waiting/trajectory", params={"schema": 1})).json()
    assert doc["turns"] == [] and doc["token_ids"] == []
    await server.aclose()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/admin/pause", {"mode": "retract"}, "mode"),
        ("/admin/resume", {"weight_version": 5}, "weight_version"),
        ("/admin/resume", {"weight_version": ""}, "weight_version"),
    ],
    ids=["unknown-mode", "version-not-string", "version-empty"],
)
async def test_pause_and_resume_refuse_bad_bodies(
    stack: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    """In the OpenAI error shape, naming the field; the gate is unchanged
    and the connection serves the next request."""
    refused = await stack.client.post(path, json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "invalid_request"
    assert refused.json()["error"]["param"] == param
    assert not stack.ctx.pause.paused and stack.ctx.pause.declared_version is None
    assert (await stack.client.get("/health")).status_code == 200
