"""The SGLang emulator during weight updates, over real sockets: its
``/update_weight_version``, ``/update_weights_from_disk``,
``/pause_generation`` (abort, retract, in_place), ``/continue_generation``
and ``/abort_request`` routes, their defaults and refusals, and what an
aborted or paused request answers on ``/v1/chat/completions`` and
``/generate`` (docs/emulator.md#weight-updates).

Time is virtual (trio's autojump clock): a request decodes one token per
``STEP`` seconds, so a test lets it decode by sleeping virtual time and
knows exactly how many tokens it had when something happened."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from rollout_session.emulator.weights import Run
from rollout_session.emulator.worker import Emulator
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import MESSAGES, chat, render

STEP = 0.25  # virtual seconds per decoded token
TOKENS = 12  # every text answer's length (completion_tokens)
LATENCY: dict[str, Any] = {"decode_s_per_token": STEP, "completion_tokens": TOKENS}
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
WAITING = {"type": "abort", "message": "Abort in waiting queue"}
GENERATE_META = [
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
    "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
    "reasoning_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
]  # fmt: skip
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}


@pytest.fixture(autouse=True)
def virtual_time(autojump_clock: trio.testing.MockClock) -> None:
    """Every test takes ``autojump_clock`` (pytest-trio runs a test on the
    clock among its own arguments); it jumps only after 20 ms of real
    idleness, so loopback I/O in flight never lets it skip ahead of a
    request's decode."""
    autojump_clock.autojump_threshold = 0.02


def prompt_of(tokenizer: Any) -> list[int]:
    return render(tokenizer, MESSAGES, add_generation_prompt=True)


def entries(answer: dict[str, Any]) -> list[list[Any]]:
    """A chat answer's meta_info.output_token_logprobs, or /generate's."""
    meta = answer["choices"][0]["meta_info"] if "choices" in answer else answer["meta_info"]
    found: list[list[Any]] = meta["output_token_logprobs"]
    return found


def ids_of(answer: dict[str, Any]) -> list[int]:
    return [e[1] for e in entries(answer)]


def run_of(emulator: Emulator, key: str) -> Run:
    [run] = [r for r in emulator.weights.runs() if r.key == key]
    return run


async def decoding(emulator: Emulator, key: str) -> Run:
    """Wait until the request ``key`` is decoding; its run."""
    await emulator.wait_until(
        lambda: any(r.key == key and r.progress.phase == "decode" for r in emulator.weights.runs())
    )
    return run_of(emulator, key)


class Calls:
    """Requests sent in the background; their answers by name."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.answers: dict[str, Any] = {}

    def start(self, name: str, call: Callable[[], Awaitable[Any]]) -> None:
        async def one() -> None:
            self.answers[name] = await call()

        self.nursery.start_soon(one)


def chat_body(prompt: list[int], rid: str, **fields: Any) -> dict[str, Any]:
    return {"input_ids": prompt, "rid": rid, "return_meta_info": True, **fields}


def generate_body(prompt: list[int], rid: str, **fields: Any) -> dict[str, Any]:
    return {"input_ids": prompt, "rid": rid, "return_logprob": True, **fields}


async def generate(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def post(client: httpx.AsyncClient, path: str, body: Any = None) -> httpx.Response:
    return await client.post(path, json=body if body is not None else {})


def flat_error(response: httpx.Response) -> str:
    """SGLang's validation error: 400, flat, type "Bad Request"."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert (body["object"], body["type"], body["code"], body["param"]) == (
        "error",
        "Bad Request",
        400,
        None,
    )
    message: str = body["message"]
    return message


# -- /abort_request: the partial answer --------------------------------------------------


@pytest.mark.parametrize("route", ["chat", "generate"])
async def test_an_abort_mid_decode_answers_the_tokens_so_far(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any, route: str
) -> None:
    """Aborted after 3.5 steps, the request still runs one decode step
    (SGLang's to_finish): 4 tokens, the uninterrupted answer's first four,
    with their logprobs, finish_reason abort, HTTP 200."""
    client, emulator = await serve(**LATENCY)
    prompt = prompt_of(tokenizer)
    send = chat if route == "chat" else generate
    make = chat_body if route == "chat" else generate_body
    whole = await send(client, make(prompt, "whole"))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("cut", lambda: send(client, make(prompt, "cut")))
        await decoding(emulator, "cut")
        await trio.sleep(3.5 * STEP)
        response = await post(client, "/abort_request", {"rid": "cut"})
        assert (response.status_code, response.content) == (200, b"")
    cut = calls.answers["cut"]
    assert entries(cut) == entries(whole)[:4]
    if route == "chat":
        [choice] = cut["choices"]
        assert (choice["finish_reason"], choice["matched_stop"]) == ("abort", None)
        assert choice["meta_info"]["finish_reason"] == ABORTED
        assert choice["message"]["content"] == tokenizer.decode(ids_of(cut))
        assert cut["usage"]["completion_tokens"] == choice["meta_info"]["completion_tokens"] == 4
        assert choice["meta_info"]["prompt_tokens"] == len(prompt)
    else:
        meta = cut["meta_info"]
        assert list(meta) == GENERATE_META
        assert meta["finish_reason"] == ABORTED and meta["completion_tokens"] == 4
        assert cut["output_ids"] == ids_of(cut)
        assert cut["text"] == tokenizer.decode(ids_of(cut))
        assert (meta["weight_version"], meta["num_retractions"]) == ("default", 0)
    assert emulator.aborted == 1 and emulator.running == set()
    assert [(a.cause, a.ended) for a in emulator.weights.aborts] == [("abort_request", 1)]


async def test_an_abort_in_the_last_step_keeps_the_whole_answer(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """The decode step an abort lets run can be the last: every token, the
    end token too, and still finish_reason abort."""
    client, emulator = await serve(**LATENCY)
    prompt = prompt_of(tokenizer)
    keep = {"sampling_params": {"skip_special_tokens": False}}
    whole = await generate(client, generate_body(prompt, "whole", **keep))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("cut", lambda: generate(client, generate_body(prompt, "cut", **keep)))
        await decoding(emulator, "cut")
        await trio.sleep((TOKENS - 0.5) * STEP)
        await post(client, "/abort_request", {"rid": "cut"})
    cut = calls.answers["cut"]
    assert cut["output_ids"] == whole["output_ids"] and cut["meta_info"]["finish_reason"] == ABORTED
    # Not a matched stop: the end token is not trimmed from the text.
    assert cut["text"] == whole["text"] + "<|im_end|>" == tokenizer.decode(cut["output_ids"])


@pytest.mark.parametrize("route", ["chat", "generate"])
async def test_an_abort_in_the_waiting_queue_answers_the_short_meta_info(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any, route: str
) -> None:
    """Aborted before it was scheduled (its base latency), the tokenizer
    manager answers it: no tokens, and a meta_info without prompt, cached
    or reasoning counts (the chat route's usage then counts 0 prompt tokens)."""
    client, emulator = await serve(base_latency_s=5.0, **LATENCY)
    prompt = prompt_of(tokenizer)
    send = chat if route == "chat" else generate
    make = chat_body if route == "chat" else generate_body
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("queued", lambda: send(client, make(prompt, "queued")))
        await emulator.wait_until(lambda: "queued" in emulator.running)
        await post(client, "/abort_request", {"rid": "queued"})
    answer = calls.answers["queued"]
    if route == "chat":
        [choice] = answer["choices"]
        assert list(choice["meta_info"]) == [
            "id", "finish_reason", "weight_version", "e2e_latency", "output_token_logprobs",
            "output_token_logprobs_length", "completion_tokens",
        ]  # fmt: skip
        assert choice["meta_info"]["finish_reason"] == WAITING
        assert choice["finish_reason"] == "abort" and choice["message"]["content"] == ""
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["completion_tokens"] == 0
    else:
        assert list(answer["meta_info"]) == [
            "id", "finish_reason", "weight_version", "e2e_latency", "input_token_logprobs",
            "output_token_logprobs", "output_token_logprobs_length", "completion_tokens",
        ]  # fmt: skip
        assert answer["meta_info"]["finish_reason"] == WAITING
        assert (answer["text"], answer["output_ids"]) == ("", [])


async def test_a_request_waiting_for_the_gpu_is_in_the_waiting_queue(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """With one GPU, a request queued behind another's prefill is still in
    SGLang's waiting queue: aborted there, it has no token and the short
    answer; the one prefilling keeps the prefill's token."""
    client, emulator = await serve(gpu_contention=True, prefill_s_per_token=0.04, **LATENCY)
    prompt = prompt_of(tokenizer)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("first", lambda: generate(client, generate_body(prompt, "first")))
        await emulator.wait_until(lambda: emulator.weights.gpu.prefilling)
        calls.start("second", lambda: generate(client, generate_body(prompt, "second")))
        await emulator.wait_until(lambda: emulator.weights.gpu.prefill_waiting == 2)
        assert [r.progress.phase for r in emulator.weights.runs()] == ["prefill", "queued"]
        await post(client, "/abort_request", {"abort_all": True})
    first, second = calls.answers["first"], calls.answers["second"]
    assert first["meta_info"]["finish_reason"] == ABORTED and len(first["output_ids"]) == 1
    assert second["meta_info"]["finish_reason"] == WAITING and second["output_ids"] == []


async def test_abort_request_matches_by_rid_prefix_and_abort_all(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """A known rid aborts every request whose rid starts with it (SGLang's
    scheduler matches by prefix); an unknown rid and an empty one without
    abort_all abort nothing; abort_all aborts everything."""
    client, emulator = await serve(**LATENCY)
    prompt = prompt_of(tokenizer)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        for rid in ("r", "r-2", "s"):
            calls.start(rid, functools.partial(chat, client, chat_body(prompt, rid)))
        for rid in ("r", "r-2", "s"):
            await decoding(emulator, rid)
        for body in ({"rid": "nope"}, {"rid": ""}, {}, {"rid": "r-"}):
            response = await post(client, "/abort_request", body)
            assert (response.status_code, response.content) == (200, b"")
        assert emulator.aborted == 0
        await post(client, "/abort_request", {"rid": "r"})
        assert emulator.aborted == 2
        await post(client, "/abort_request", {"abort_all": True})
    finish = {rid: a["choices"][0]["finish_reason"] for rid, a in calls.answers.items()}
    assert finish == {"r": "abort", "r-2": "abort", "s": "abort"}
    assert [(a.cause, a.ended) for a in emulator.weights.aborts] == [
        ("abort_request", 2),
        ("abort_request", 1),
    ]


# -- /update_weight_version ----------------------------------------------------------------


async def test_update_weight_version_aborts_by_default(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """abort_all_requests defaults to true: the request in flight ends with
    its tokens so far; the one extra step runs under the new label."""
    client, emulator = await serve(weight_version="v1", **LATENCY)
    prompt = prompt_of(tokenizer)
    whole = await generate(client, generate_body(prompt, "whole"))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("cut", lambda: generate(client, generate_body(prompt, "cut")))
        await decoding(emulator, "cut")
        await trio.sleep(2.5 * STEP)
        response = await post(client, "/update_weight_version", {"new_version": "v2"})
        assert (response.status_code, response.json()) == (
            200,
            {"success": True, "message": "Weight version updated to v2", "new_version": "v2"},
        )
    meta = calls.answers["cut"]["meta_info"]
    assert meta["finish_reason"] == ABORTED and meta["completion_tokens"] == 3
    assert meta["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 2},
        {"version": "v2", "start": 2, "end": 3},
    ]
    assert meta["weight_version"] == "v2"
    assert calls.answers["cut"]["output_ids"] == whole["output_ids"][:3]
    assert [e[0] for e in entries(calls.answers["cut"])][:2] == [e[0] for e in entries(whole)][:2]
    assert emulator.weight_version == "v2"
    assert [(a.cause, a.ended) for a in emulator.weights.aborts] == [("update_weight_version", 1)]


async def test_a_request_spanning_a_version_change(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """Without the abort the request decodes on: its tokens before the
    change are v1's, the rest v2's (spans, weight_version the finish's),
    and only v2's logprobs change (the model's under v2); the ids are the same."""
    client, emulator = await serve(weight_version="v1", **LATENCY)
    prompt = prompt_of(tokenizer)
    whole = await chat(client, chat_body(prompt, "whole"))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("span", lambda: chat(client, chat_body(prompt, "span")))
        await decoding(emulator, "span")
        await trio.sleep(4.5 * STEP)
        body = {"new_version": "v2", "abort_all_requests": False}
        assert (await post(client, "/update_weight_version", body)).status_code == 200
    answer = calls.answers["span"]
    meta = answer["choices"][0]["meta_info"]
    spans = [{"version": "v1", "start": 0, "end": 4}, {"version": "v2", "start": 4, "end": TOKENS}]
    assert meta["weight_versions"] == spans and meta["weight_version"] == "v2"
    assert answer["metadata"] == {"weight_version": "v2", "weight_versions": spans}
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert ids_of(answer) == ids_of(whole)
    before, after = [e[0] for e in entries(whole)], [e[0] for e in entries(answer)]
    assert after[:4] == before[:4]
    # v2's tokens: the model's logprobs in context under v2 (LogprobModel).
    v2 = emulator.logprob_model.score([*prompt, *ids_of(whole)], "v2", len(prompt) + 4)
    assert after[4:] == v2.logprobs() != before[4:]
    # A request sampled wholly under v2: one span, not reported; its
    # logprobs are the v2 policy's (the same as above, position by position).
    later = await chat(client, chat_body(prompt, "later"))
    assert "weight_versions" not in later["choices"][0]["meta_info"] and "metadata" not in later
    assert later["choices"][0]["meta_info"]["weight_version"] == "v2"
    assert [e[0] for e in entries(later)][4:] == after[4:]
    assert emulator.aborted == 0


async def test_model_info_reports_the_version_server_info_the_launch_one(
    autojump_clock: trio.testing.MockClock,
    serve: Serve,
) -> None:
    client, _ = await serve(weight_version="v1")
    await post(client, "/update_weight_version", {"new_version": "v2"})
    for path in ("/get_model_info", "/model_info"):
        assert (await client.get(path)).json()["weight_version"] == "v2"
    for path in ("/server_info", "/get_server_info"):
        assert (await client.get(path)).json()["weight_version"] == "v1"


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/update_weight_version", {}, "new_version: Field required"),
        ("/update_weight_version", {"new_version": 3},
         "new_version: Input should be a valid string"),
        ("/update_weight_version", {"new_version": "v", "abort_all_requests": "maybe"},
         "abort_all_requests: Input should be a valid boolean, unable to interpret input"),
        ("/update_weights_from_disk", {}, "model_path: Field required"),
        ("/update_weights_from_disk", {"model_path": "/m", "token_step": "x"},
         "token_step: Input should be a valid integer, unable to parse string as an integer"),
        ("/pause_generation", {"mode": "sleep"},
         "mode: Input should be 'abort', 'retract' or 'in_place'"),
        ("/pause_generation", [], "body: Input should be a valid dictionary"),
        ("/continue_generation", {"torch_empty_cache": 2},
         "torch_empty_cache: Input should be a valid boolean, unable to interpret input"),
        ("/abort_request", {"rid": 7}, "rid: Input should be a valid string"),
    ],
    ids=[
        "version-missing", "version-type", "abort-flag", "path-missing", "token-step",
        "mode", "not-object", "continue-flag", "rid-type",
    ],
)  # fmt: skip
async def test_bodies_are_refused_in_sglangs_shape(
    autojump_clock: trio.testing.MockClock, serve: Serve, path: str, body: Any, message: str
) -> None:
    client, emulator = await serve()
    assert flat_error(await client.post(path, json=body)) == message
    assert (emulator.weight_version, emulator.paused) == ("default", False)


@pytest.mark.parametrize(
    "path", ["/update_weight_version", "/pause_generation", "/continue_generation"]
)
async def test_a_body_is_required(
    autojump_clock: trio.testing.MockClock, serve: Serve, path: str
) -> None:
    """FastAPI's required ``Body()``: an empty body is refused, even where
    every field has a default; so is one that is not JSON."""
    client, _ = await serve()
    assert flat_error(await client.post(path, content=b"")) == "body: Field required"
    refused = await client.post(path, content=b"{", headers={"content-type": "application/json"})
    assert flat_error(refused).startswith("body: JSON decode error")


# -- /pause_generation, /continue_generation ---------------------------------------------


async def test_pause_in_abort_mode_aborts_and_holds_new_requests(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """The default mode: the request in flight ends (tokens so far); a
    request arriving while paused waits at the tokenizer manager's gate,
    unseen by aborts, and runs whole after /continue_generation."""
    client, emulator = await serve(**LATENCY)
    prompt = prompt_of(tokenizer)
    whole = await generate(client, generate_body(prompt, "whole"))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("cut", lambda: generate(client, generate_body(prompt, "cut")))
        await decoding(emulator, "cut")
        await trio.sleep(1.5 * STEP)
        response = await post(client, "/pause_generation")
        assert (response.status_code, response.json()) == (200, PAUSED)
        assert "cut" in calls.answers  # the pause returned once it had ended
        assert emulator.paused and emulator.weights.pause_mode == "abort"
        calls.start("held", lambda: generate(client, generate_body(prompt, "held")))
        await emulator.wait_until(lambda: emulator.held == 1)
        await post(client, "/abort_request", {"abort_all": True})
        await post(client, "/abort_request", {"rid": "held"})
        assert emulator.running == set() and "held" not in calls.answers
        response = await post(client, "/continue_generation")
        assert (response.status_code, response.json()) == (200, CONTINUED)
    assert calls.answers["cut"]["output_ids"] == whole["output_ids"][:2]
    assert calls.answers["held"]["output_ids"] == whole["output_ids"]
    assert calls.answers["held"]["meta_info"]["finish_reason"]["type"] == "stop"
    assert emulator.aborted == 1 and emulator.held == 0 and not emulator.paused


@pytest.mark.parametrize("contention", [False, True], ids=["independent", "contention"])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_retract_and_in_place_keep_the_request(
    autojump_clock: trio.testing.MockClock,
    serve: Serve,
    tokenizer: Any,
    mode: str,
    contention: bool,
) -> None:
    """The scheduler stops: the request decodes nothing while paused and
    finishes whole after /continue_generation; retracted, it prefills its
    prompt and the 3 tokens it had again (num_retractions 1). New requests
    wait at the gate meanwhile."""
    client, emulator = await serve(
        prefill_s_per_token=0.01, gpu_contention=contention, cache_capacity_tokens=0, **LATENCY
    )
    prompt = prompt_of(tokenizer)
    whole = await generate(client, generate_body(prompt, "whole"))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("kept", lambda: generate(client, generate_body(prompt, "kept")))
        run = await decoding(emulator, "kept")
        await trio.sleep(3.5 * STEP)
        response = await post(client, "/pause_generation", {"mode": mode})
        assert (response.status_code, response.json()) == (200, PAUSED)
        paused_at = trio.current_time()
        assert emulator.weights.gpu.decoded(run.progress) == 3
        assert run.progress.phase == ("queued" if mode == "retract" else "decode")
        calls.start("held", lambda: generate(client, generate_body(prompt, "held")))
        await emulator.wait_until(lambda: emulator.held == 1)
        await trio.sleep(2.0)  # paused: nothing decodes
        assert emulator.weights.gpu.decoded(run.progress) == 3 and calls.answers == {}
        await post(client, "/continue_generation")
        resumed_at = trio.current_time()
    kept = calls.answers["kept"]
    assert kept["output_ids"] == whole["output_ids"] == calls.answers["held"]["output_ids"]
    assert kept["meta_info"]["finish_reason"]["type"] == "stop"
    retracted = mode == "retract"
    assert kept["meta_info"]["num_retractions"] == int(retracted)
    assert emulator.weights.retractions == int(retracted)
    # Its GPU time: the prompt's prefill, 3.5 steps, the pause; then, when
    # retracted, a prefill of prompt + 3 tokens and 9 steps (the half step
    # is lost), else the 8.5 steps left. With contention the held request's
    # prefill, after the pause, stops its decode as long.
    prefill = 0.01 * len(prompt)
    rest = 0.01 * (len(prompt) + 3) + (TOKENS - 3) * STEP if retracted else (TOKENS - 3.5) * STEP
    stalled = prefill if contention else 0.0
    expected = prefill + 3.5 * STEP + (resumed_at - paused_at) + rest + stalled
    assert kept["meta_info"]["e2e_latency"] == pytest.approx(expected)


async def test_a_pause_in_abort_mode_ends_a_retracted_request_in_the_queue(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """A retracted request waits in the scheduler's queue with its tokens:
    an abort answers it from there (the waiting-queue answer, its tokens)."""
    client, emulator = await serve(**LATENCY)
    prompt = prompt_of(tokenizer)
    whole = await generate(client, generate_body(prompt, "whole"))
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("kept", lambda: generate(client, generate_body(prompt, "kept")))
        await decoding(emulator, "kept")
        await trio.sleep(5.5 * STEP)
        await post(client, "/pause_generation", {"mode": "retract"})
        await post(client, "/pause_generation", {"mode": "abort"})
        await post(client, "/continue_generation")
    answer = calls.answers["kept"]
    assert answer["meta_info"]["finish_reason"] == WAITING
    assert answer["output_ids"] == whole["output_ids"][:5]
    assert emulator.weights.pauses == {"retract": 1, "abort": 1}


# -- /update_weights_from_disk ------------------------------------------------------------


async def test_update_weights_from_disk_defaults(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """Nothing is loaded; the model path, load format and version move and
    the radix cache is flushed (flush_cache defaults to true)."""
    client, emulator = await serve(weight_version="v1")
    prompt = prompt_of(tokenizer)
    first = await chat(client, chat_body(prompt, "first"))
    again = await chat(client, chat_body(prompt, "again"))
    assert again["choices"][0]["meta_info"]["cached_tokens"] > 0
    body = {"model_path": "/ckpt/step-2", "weight_version": "v2"}
    response = await post(client, "/update_weights_from_disk", body)
    assert (response.status_code, response.json()) == (
        200,
        {
            "success": True,
            "message": "Succeeded to update model weights. Weight version updated to v2.",
            "num_paused_requests": 0,
        },
    )
    info = (await client.get("/model_info")).json()
    assert (info["model_path"], info["load_format"], info["weight_version"]) == (
        "/ckpt/step-2",
        "auto",
        "v2",
    )
    after = await chat(client, chat_body(prompt, "after"))
    assert after["choices"][0]["meta_info"]["cached_tokens"] == 0
    assert ids_of(after) == ids_of(first)  # the ids never depend on the weights
    assert emulator.weights.cache_flushes == 1
    kept = await post(client, "/update_weights_from_disk", {"model_path": "/m", "flush_cache": 0})
    assert kept.json()["message"] == "Succeeded to update model weights."
    assert (emulator.weight_version, emulator.weights.cache_flushes) == ("v2", 1)


async def test_update_weights_from_disk_waits_for_the_requests_in_flight(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """Not paused, the update takes the writer lock: the request in flight
    finishes (abort_all_requests defaults to false), a new one waits for
    the update, and runs under the new version."""
    client, emulator = await serve(weight_version="v1", **LATENCY)
    prompt = prompt_of(tokenizer)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("running", lambda: generate(client, generate_body(prompt, "running")))
        await decoding(emulator, "running")
        body = {"model_path": "/m", "weight_version": "v2"}
        calls.start("update", lambda: post(client, "/update_weights_from_disk", body))
        await emulator.wait_until(lambda: emulator.weights._writers == 1)
        calls.start("new", lambda: generate(client, generate_body(prompt, "new")))
        await emulator.wait_until(lambda: emulator.held == 1)
    running, new = calls.answers["running"]["meta_info"], calls.answers["new"]["meta_info"]
    assert running["finish_reason"]["type"] == "stop" and running["weight_version"] == "v1"
    assert new["weight_version"] == "v2" and calls.answers["update"].json()["success"] is True
    assert emulator.aborted == 0


async def test_update_weights_from_disk_can_abort_first(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    client, emulator = await serve(**LATENCY)
    prompt = prompt_of(tokenizer)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("cut", lambda: chat(client, chat_body(prompt, "cut")))
        await decoding(emulator, "cut")
        await trio.sleep(0.5 * STEP)
        body = {"model_path": "/m", "abort_all_requests": True, "weight_version": "v2"}
        assert (await post(client, "/update_weights_from_disk", body)).status_code == 200
    meta = calls.answers["cut"]["choices"][0]["meta_info"]
    assert meta["finish_reason"] == ABORTED and meta["completion_tokens"] == 1
    # The update waited for it to end (the writer lock): its last step ran
    # under the old weights.
    assert meta["weight_version"] == "default"
    assert emulator.weight_version == "v2"
    assert [(a.cause, a.ended) for a in emulator.weights.aborts] == [
        ("update_weights_from_disk", 1)
    ]


@pytest.mark.parametrize(("mode", "flushed"), [("retract", True), ("in_place", False)])
async def test_an_update_while_paused_flushes_only_an_idle_scheduler(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any, mode: str, flushed: bool
) -> None:
    """Paused, the update does not wait. Retracted requests are queued,
    which a paused scheduler ignores: the flush succeeds. A request paused
    in place is running: the flush fails the call (400, success false),
    though the scheduler already labels new tokens with the new version;
    /model_info keeps the old one. Either way the request resumes and
    spans the versions."""
    client, emulator = await serve(weight_version="v1", **LATENCY)
    prompt = prompt_of(tokenizer)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("kept", lambda: generate(client, generate_body(prompt, "kept")))
        await decoding(emulator, "kept")
        await trio.sleep(4.5 * STEP)
        await post(client, "/pause_generation", {"mode": mode})
        body = {"model_path": "/m", "weight_version": "v2"}
        response = await post(client, "/update_weights_from_disk", body)
        await post(client, "/continue_generation")
    answer = response.json()
    assert (response.status_code, answer["success"]) == ((200, True) if flushed else (400, False))
    if not flushed:
        assert answer["message"] == (
            "Weights were updated, but the cache was not flushed because requests are still "
            "running or queued. Retract or finish them, then call /flush_cache."
        )
    meta = calls.answers["kept"]["meta_info"]
    assert meta["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 4},
        {"version": "v2", "start": 4, "end": TOKENS},
    ]
    info = (await client.get("/get_model_info")).json()
    assert info["weight_version"] == ("v2" if flushed else "v1")
    assert info["model_path"] == ("/m" if flushed else "rollout-session/emulator")
    assert emulator.weights.cache_flushes == int(flushed)


async def test_stats_report_the_weight_state(
    autojump_clock: trio.testing.MockClock, serve: Serve
) -> None:
    client, _ = await serve(weight_version="v1")
    await post(client, "/pause_generation", {"mode": "in_place"})
    await post(client, "/update_weight_version", {"new_version": "v2"})
    weights = (await client.get("/emulator/stats")).json()["weights"]
    assert weights == {
        "weight_version": "v2",
        "reported_weight_version": "v2",
        "paused": True,
        "pause_mode": "in_place",
        "frozen": True,
        "held": 0,
        "running": [],
        "versions": ["v2"],
        "aborts": [{"cause": "update_weight_version", "ended": 0}],
        "aborted": 0,
        "retractions": 0,
        "rejected": 0,
        "cache_flushes": 0,
        "pauses": {"in_place": 1},
    }
