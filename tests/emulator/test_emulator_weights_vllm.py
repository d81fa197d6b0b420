"""The vLLM emulator during weight updates, over real sockets: the RL routes
vLLM 0.33 serves with ``VLLM_SERVER_DEV_MODE=1`` (``/pause`` in abort,
wait and keep mode, ``/resume``, ``/is_paused``, ``/update_weight_version``,
``/weight_info``, ``/abort_requests``), their defaults and refusals, and
what ``/inference/v1/generate`` answers around them: the tokens so far
after an abort, 503 while paused, ``weight_versions`` spans and the
policy's logprobs across a label change (docs/emulator.md#weight-updates).

Time is virtual, as in `test_emulator_weights`."""

from __future__ import annotations

import argparse
import functools
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from rollout_session.emulator.cli import add_arguments, config_from_args
from rollout_session.emulator.config import EmulatorConfig
from rollout_session.emulator.weights import Run
from rollout_session.emulator.worker import Emulator
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator_vllm import ABORT, GENERATE, contract_body, error_of, prompt_ids
from tests.emulator.test_emulator_weights import STEP, TOKENS, Calls

VLLM: dict[str, Any] = {
    "engine": "vllm",
    "enable_scale_out": True,
    "dev_mode": True,
    "decode_s_per_token": STEP,
    "completion_tokens": TOKENS,
}
RL_ROUTES = [
    ("/pause", "POST"),
    ("/resume", "POST"),
    ("/is_paused", "GET"),
    ("/update_weight_version", "POST"),
    ("/weight_info", "GET"),
    ("/abort_requests", "POST"),
]
PAUSED_503 = "Generation is paused. Please retry after it resumes."


@pytest.fixture(autouse=True)
def virtual_time(autojump_clock: trio.testing.MockClock) -> None:
    autojump_clock.autojump_threshold = 0.02


def engine_id(request_id: str) -> str:
    return f"generate-tokens-{request_id}"


def body_for(prompt: list[int], request_id: str, **fields: Any) -> dict[str, Any]:
    return contract_body(prompt, request_id=request_id, output_mode="tokens", **fields)


async def send(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await client.post(GENERATE, json=body)


def choice_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def logprobs_of(choice: dict[str, Any]) -> list[float]:
    return [e["logprob"] for e in choice["logprobs"]["content"]]


async def decoding(emulator: Emulator, request_id: str) -> Run:
    key = engine_id(request_id)
    await emulator.wait_until(
        lambda: any(r.key == key and r.progress.phase == "decode" for r in emulator.weights.runs())
    )
    [run] = [r for r in emulator.weights.runs() if r.key == key]
    return run


@pytest.mark.parametrize("dev_mode", [False, True], ids=["default", "dev-mode"])
async def test_rl_routes_only_in_dev_mode(
    autojump_clock: trio.testing.MockClock, serve: Serve, dev_mode: bool
) -> None:
    client, _ = await serve(engine="vllm", dev_mode=dev_mode)
    for path, method in RL_ROUTES:
        response = await client.request(method, path, json={"new_version": "v"})
        if dev_mode:
            assert response.status_code == 200, (path, response.text)
        else:
            assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})


async def test_is_paused_resume_and_weight_info(
    autojump_clock: trio.testing.MockClock, serve: Serve
) -> None:
    client, emulator = await serve(**VLLM, weight_version="v1")
    assert (await client.get("/is_paused")).json() == {"is_paused": False}
    assert (await client.get("/weight_info")).json() == {"weight_version": "v1"}
    assert (await client.post("/pause")).json() == {"status": "paused"}
    assert (await client.get("/is_paused")).json() == {"is_paused": True}
    assert emulator.weights.pause_mode == "abort"  # the default mode
    assert (await client.post("/resume")).json() == {"status": "resumed"}
    assert (await client.get("/is_paused")).json() == {"is_paused": False}
    response = await client.post("/update_weight_version", json={"new_version": "v2"})
    assert response.json() == {"success": True, "new_version": "v2"}
    assert (await client.get("/weight_info")).json() == {"weight_version": "v2"}


async def test_abort_mode_aborts_and_refuses_until_resumed(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """The request in flight ends with the tokens already output (3 of 3.5
    steps, finish_reason abort); until /resume a new request is refused
    with vLLM's retryable 503; after it, served."""
    client, emulator = await serve(**VLLM)
    prompt = prompt_ids(tokenizer)
    whole = choice_of(await send(client, body_for(prompt, "whole")))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("cut", lambda: send(client, body_for(prompt, "cut")))
        await decoding(emulator, "cut")
        await trio.sleep(3.5 * STEP)
        assert (await client.post("/pause")).json() == {"status": "paused"}
        assert "cut" in calls.answers  # /pause returned once it had ended
    cut = choice_of(calls.answers["cut"])
    assert (cut["finish_reason"], cut["stop_reason"]) == ("abort", None)
    assert cut["token_ids"] == whole["token_ids"][:3]
    assert logprobs_of(cut) == logprobs_of(whole)[:3]
    assert cut["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    refused = await send(client, body_for(prompt, "refused"))
    error = error_of(refused, 503, "ServiceUnavailableError")
    assert error["message"] == PAUSED_503
    assert emulator.weights.rejected == 1
    await client.post("/resume")
    assert (
        choice_of(await send(client, body_for(prompt, "after")))["token_ids"] == whole["token_ids"]
    )
    assert [(a.cause, a.ended) for a in emulator.weights.aborts] == [("pause", 1)]


async def test_wait_mode_lets_the_requests_finish(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """/pause?mode=wait returns once the request in flight has finished
    (whole; relabelled meanwhile, it spans both labels); a request sent
    meanwhile is refused with 503."""
    client, emulator = await serve(**VLLM)
    prompt = prompt_ids(tokenizer)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("running", lambda: send(client, body_for(prompt, "running")))
        await decoding(emulator, "running")
        await trio.sleep(2.5 * STEP)
        calls.start("pause", lambda: client.post("/pause", params={"mode": "wait"}))
        await emulator.wait_until(lambda: emulator.paused)
        error_of(await send(client, body_for(prompt, "new")), 503, "ServiceUnavailableError")
        await client.post("/update_weight_version", json={"new_version": "v2"})
        assert "pause" not in calls.answers
    assert calls.answers["pause"].json() == {"status": "paused"}
    running = choice_of(calls.answers["running"])
    assert running["finish_reason"] == "stop" and len(running["token_ids"]) == TOKENS
    assert running["weight_versions"] == [
        {"version": "default", "start": 0, "end": 2},
        {"version": "v2", "start": 2, "end": TOKENS},
    ]
    assert emulator.aborted == 0 and emulator.weights.rejected == 1


def test_dev_mode_is_a_vllm_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engine", "vllm", "--enable-scale-out", "--dev-mode"])
    assert config_from_args(args).dev_mode is True
    assert config_from_args(parser.parse_args(["--engine", "vllm"])).dev_mode is False
    with pytest.raises(ValueError, match="dev_mode is a flag of engine 'vllm'"):
        EmulatorConfig(dev_mode=True)


async def test_keep_mode_freezes_and_queues_across_a_version_change(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """/pause?mode=keep freezes the request in flight (3 tokens out);
    /update_weight_version relabels; after /resume it finishes whole: its
    first 3 tokens v1's, the rest v2's (spans), and only those logprobs
    change (the model's under v2). A request sent while paused is queued
    and sampled under v2."""
    client, emulator = await serve(**VLLM, weight_version="v1")
    prompt = prompt_ids(tokenizer)
    whole = choice_of(await send(client, body_for(prompt, "whole")))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("kept", lambda: send(client, body_for(prompt, "kept")))
        run = await decoding(emulator, "kept")
        await trio.sleep(3.5 * STEP)
        response = await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert response.json() == {"status": "paused"}
        calls.start("queued", lambda: send(client, body_for(prompt, "queued")))
        await emulator.wait_until(lambda: engine_id("queued") in emulator.running)
        await client.post("/update_weight_version", json={"new_version": "v2"})
        await trio.sleep(2.0)
        assert emulator.weights.gpu.decoded(run.progress) == 3 and calls.answers == {}
        await client.post("/resume")
    kept, queued = choice_of(calls.answers["kept"]), choice_of(calls.answers["queued"])
    assert kept["finish_reason"] == "stop" and kept["token_ids"] == whole["token_ids"]
    assert kept["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 3},
        {"version": "v2", "start": 3, "end": TOKENS},
    ]
    before, after = logprobs_of(whole), logprobs_of(kept)
    assert after[:3] == before[:3]
    v2 = emulator.logprob_model.score([*prompt, *whole["token_ids"]], "v2", len(prompt) + 3)
    assert after[3:] == v2.logprobs() != before[3:]
    assert queued["weight_versions"] == [{"version": "v2", "start": 0, "end": TOKENS}]
    assert logprobs_of(queued)[3:] == after[3:]
    assert emulator.weights.cache_flushes == 0


async def test_abort_and_wait_clear_the_prefix_cache_unless_told_not_to(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    client, emulator = await serve(**VLLM, enable_prompt_tokens_details=True)
    prompt = prompt_ids(tokenizer)

    async def cached() -> int:
        response = await send(client, body_for(prompt, "c"))
        value: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return value

    await cached()
    assert await cached() > 0
    for params, flushes in (({"clear_cache": "no"}, 0), ({"mode": "wait"}, 1), ({}, 2)):
        await client.post("/pause", params=params)
        await client.post("/resume")
        assert emulator.weights.cache_flushes == flushes
        assert (await cached() == 0) is bool(flushes)
        await cached()  # cached again


async def test_a_running_request_aborted_by_id_keeps_its_tokens(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """/inference/v1/abort_requests (the engine id) mid-decode: the tokens
    whose decode time had elapsed (vLLM keeps no extra step)."""
    client, emulator = await serve(**VLLM)
    prompt = prompt_ids(tokenizer)
    whole = choice_of(await send(client, body_for(prompt, "whole")))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("cut", lambda: send(client, body_for(prompt, "cut")))
        await decoding(emulator, "cut")
        await trio.sleep(5.5 * STEP)
        response = await client.post(ABORT, json={"request_ids": [engine_id("cut")]})
        assert (response.status_code, response.content) == (200, b"")
    cut = choice_of(calls.answers["cut"])
    assert cut["finish_reason"] == "abort" and cut["token_ids"] == whole["token_ids"][:5]
    assert calls.answers["cut"].json()["usage"]["completion_tokens"] == 5
    assert [(a.cause, a.ended) for a in emulator.weights.aborts] == [
        ("inference/v1/abort_requests", 1)
    ]


async def test_the_rl_abort_requests_route(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """/abort_requests: the ids given (engine ids), answered with how many
    were given; without ids, every request in flight."""
    client, emulator = await serve(**VLLM)
    prompt = prompt_ids(tokenizer)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        for name in ("a", "b", "c"):
            calls.start(name, functools.partial(send, client, body_for(prompt, name)))
        for name in ("a", "b", "c"):
            await decoding(emulator, name)
        response = await client.post("/abort_requests", json={"request_ids": [engine_id("a"), "x"]})
        assert response.json() == {"status": "aborted", "aborted": 2}
        assert emulator.aborted == 1
        response = await client.post("/abort_requests", json={})
        assert response.json() == {"status": "aborted", "aborted": 2}
    assert {k: choice_of(v)["finish_reason"] for k, v in calls.answers.items()} == dict.fromkeys(
        "abc", "abort"
    )
    assert [(a.cause, a.ended) for a in emulator.weights.aborts] == [
        ("abort_requests", 1),
        ("abort_requests", 2),
    ]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "type_", "message"),
    [
        ("POST", "/pause", {"params": {"mode": "sleep"}}, 400, "Bad Request",
         "1 validation error:\n  {'type': 'literal_error', 'loc': 'query.mode', 'msg': \"Input "
         "should be 'abort', 'wait' or 'keep'\", 'input': 'sleep', 'ctx': {'expected': "
         "\"'abort', 'wait' or 'keep'\"}}"),
        ("POST", "/pause", {"params": {"clear_cache": "maybe"}}, 400, "Bad Request",
         "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'query.clear_cache', 'msg': "
         "'Input should be a valid boolean, unable to interpret input', 'input': 'maybe'}"),
        ("POST", "/update_weight_version", {"json": {}}, 400, "Bad Request",
         "1 validation error:\n  {'type': 'missing', 'loc': 'body.new_version', 'msg': "
         "'Field required', 'input': 'None'}"),
        ("POST", "/update_weight_version", {"json": {"new_version": 2}}, 400, "Bad Request",
         "1 validation error:\n  {'type': 'string_type', 'loc': 'body.new_version', 'msg': "
         "'Input should be a valid string', 'input': '2'}"),
        ("POST", "/update_weight_version", {"content": b"{"}, 400, "Bad Request",
         "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode "
         "error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name "
         "enclosed in double quotes'}}"),
        ("POST", "/abort_requests", {"content": b"{"}, 400, "Bad Request", "Invalid JSON format"),
        ("POST", "/abort_requests", {"json": [1]}, 400, "Bad Request",
         "Request body must be a JSON object"),
    ],
    ids=["mode", "clear-cache", "version-missing", "version-type", "version-json", "abort-json",
         "abort-list"],
)  # fmt: skip
async def test_refusals_in_vllms_shape(
    autojump_clock: trio.testing.MockClock,
    serve: Serve,
    method: str,
    path: str,
    kwargs: dict[str, Any],
    status: int,
    type_: str,
    message: str,
) -> None:
    client, emulator = await serve(**VLLM)
    error = error_of(await client.request(method, path, **kwargs), status, type_)
    assert error["message"] == message
    assert (emulator.paused, emulator.weight_version) == (False, "default")
