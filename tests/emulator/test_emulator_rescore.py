"""Prompt logprobs over real sockets, as a rescore sends them: SGLang's
prefill-only ``/generate`` (``max_new_tokens: 0``, ``return_logprob``,
``logprob_start_len``) and vLLM's ``prompt_logprobs`` on
``/inference/v1/generate``, answered in each engine's shape from the
emulator's one logprob model (`testing.logprobs`): the logprob of a token
in its context under the emulator's seed and weight version. Rescoring a
sampled answer reproduces its logprobs exactly; a teacher (another seed)
or a weight update scores the same tokens differently
(docs/emulator.md#prompt-logprobs-rescoring)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import pytest

from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import MESSAGES, TOOLS, render
from tests.emulator.test_emulator_generate import QWEN3, generate, native_error
from tests.emulator.test_emulator_vllm import GENERATE, VLLM, error_of

SEED = 5
META_KEYS = [
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
    "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
    "reasoning_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
]  # fmt: skip


def prompt_of(tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> list[int]:
    return render(tokenizer, MESSAGES, tools=tools, add_generation_prompt=True)


def prefill_body(ids: list[int], start: int = 0, **sampling: Any) -> dict[str, Any]:
    """The rescore request a session server sends SGLang."""
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, **sampling},
        "return_logprob": True,
        "logprob_start_len": start,
    }


def vllm_body(ids: list[int], **sampling: Any) -> dict[str, Any]:
    """The rescore request a session server sends vLLM."""
    return {
        "token_ids": ids,
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False, **sampling},
        "stream": False,
    }


async def vllm_generate(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(GENERATE, json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def sglang_scores(client: httpx.AsyncClient, ids: list[int]) -> list[float | None]:
    """Each token's logprob after the ones before it (the first: None)."""
    meta = (await generate(client, prefill_body(ids)))["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    return [e[0] for e in meta["input_token_logprobs"]]


async def vllm_scores(client: httpx.AsyncClient, ids: list[int]) -> list[float | None]:
    answer = await vllm_generate(client, vllm_body(ids))
    items = answer["prompt_logprobs"]
    assert len(items) == len(ids) and items[0] is None
    out: list[float | None] = [None]
    for item, token in zip(items[1:], ids[1:], strict=True):
        assert list(item) == [str(token)]
        out.append(item[str(token)]["logprob"])
    return out


Scorer = Callable[[httpx.AsyncClient, list[int]], Awaitable[list[float | None]]]
SCORERS: dict[str, tuple[dict[str, Any], Scorer]] = {
    "sglang": ({}, sglang_scores),
    "vllm": (VLLM, vllm_scores),
}


def model_like(values: list[float | None]) -> None:
    """Every logprob after the first is a finite, strictly negative float of
    at most 4 decimals; the first is None."""
    assert values[0] is None
    for value in values[1:]:
        assert isinstance(value, float) and math.isfinite(value) and value < 0, value
        assert round(value, 4) == value


# -- SGLang: prefill only ----------------------------------------------------------


@pytest.mark.parametrize("with_text", [False, True], ids=["ids", "return_text_in_logprobs"])
async def test_a_prefill_only_generate_answers_sglangs_shape(
    serve: Serve, tokenizer: Any, with_text: bool
) -> None:
    """``max_new_tokens: 0``: no token, finish ``length`` 0, one input entry
    per prompt token, the first ``[null, t0, text]``."""
    client, emulator = await serve(weight_version="w1")
    prompt = prompt_of(tokenizer)
    body = {**prefill_body(prompt), "rid": "rescore-1", "return_text_in_logprobs": with_text}
    answer = await generate(client, body)
    assert answer["text"] == "" and answer["output_ids"] == []
    meta = answer["meta_info"]
    assert list(meta) == META_KEYS
    assert meta["id"] == "rescore-1" and meta["weight_version"] == "w1"
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["completion_tokens"], meta["reasoning_tokens"]) == (0, 0)
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(prompt)
    assert [e[1] for e in entries] == prompt
    texts = [tokenizer.decode([t]) for t in prompt] if with_text else [None] * len(prompt)
    assert [e[2] for e in entries] == texts
    model_like([e[0] for e in entries])
    assert emulator.prompt_tokens == len(prompt)


@pytest.mark.parametrize("start", [1, 7, -2, -1], ids=["one", "seven", "last", "end"])
async def test_logprob_start_len_starts_the_entries(
    serve: Serve, tokenizer: Any, start: int
) -> None:
    """``logprob_start_len`` s: the entries of tokens s..n-1, the first null
    (even for s > 0), the rest the full prefill's; s = n: none."""
    client, _ = await serve()
    prompt = prompt_of(tokenizer)
    s = start % (len(prompt) + 1)
    full = await sglang_scores(client, prompt)
    meta = (await generate(client, prefill_body(prompt, s)))["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(prompt) - s
    if entries:
        assert entries[0] == [None, prompt[s], None]
        assert [e[0] for e in entries[1:]] == full[s + 1 :]
        assert [e[1] for e in entries] == prompt[s:]


@pytest.mark.parametrize("max_new_tokens", [0, 8], ids=["prefill-only", "sampling"])
async def test_a_start_past_the_prompt_is_sglangs_400(
    serve: Serve, tokenizer: Any, max_new_tokens: int
) -> None:
    client, emulator = await serve()
    prompt = prompt_of(tokenizer)
    n = len(prompt)
    body = prefill_body(prompt, n + 1, max_new_tokens=max_new_tokens)
    assert native_error(await client.post("/generate", json=body)) == (
        f"req.logprob_start_len={n + 1} is higher than the number of input tokens "
        f"len(req.origin_input_ids)={n}. Please use a smaller logprob_start_len."
    )
    assert emulator.prompt_tokens == 0


async def test_prefill_only_without_logprobs_answers_no_entries(
    serve: Serve, tokenizer: Any
) -> None:
    client, _ = await serve()
    body = {"input_ids": prompt_of(tokenizer), "sampling_params": {"max_new_tokens": 0}}
    answer = await generate(client, body)
    assert answer["output_ids"] == [] and "input_token_logprobs" not in answer["meta_info"]
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_prompt_and_output_logprobs_in_one_sampling_request(
    serve: Serve, tokenizer: Any
) -> None:
    """With tokens to sample, ``logprob_start_len`` 0 gives the prompt's
    entries and the answer's, from the same model: a prefill of prompt +
    answer scores them alike."""
    client, _ = await serve()
    prompt = prompt_of(tokenizer)
    body = {**prefill_body(prompt, max_new_tokens=64, sampling_seed=SEED)}
    meta = (await generate(client, body))["meta_info"]
    inputs = [e[0] for e in meta["input_token_logprobs"]]
    outputs = [e[0] for e in meta["output_token_logprobs"]]
    ids = [e[1] for e in meta["output_token_logprobs"]]
    assert len(inputs) == len(prompt) and ids
    assert await sglang_scores(client, prompt + ids) == inputs + outputs


async def test_logprob_start_len_caps_the_prefix_cache(serve: Serve, tokenizer: Any) -> None:
    """SGLang reuses cached KV only up to ``logprob_start_len``
    (``Req._compute_max_prefix_len``); without prompt logprobs, as usual."""
    client, _ = await serve()
    prompt = prompt_of(tokenizer) * 4  # several 16-token blocks
    plain = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}}
    await generate(client, plain)
    assert (await generate(client, plain))["meta_info"]["cached_tokens"] >= 32
    capped = (await generate(client, prefill_body(prompt, 20)))["meta_info"]["cached_tokens"]
    assert 0 < capped <= 20
    assert (await generate(client, prefill_body(prompt)))["meta_info"]["cached_tokens"] == 0


# -- vLLM: prompt_logprobs -------------------------------------------------------


@pytest.mark.parametrize("detokenize", [False, True], ids=["ids", "detokenized"])
async def test_vllm_prompt_logprobs_shape(serve: Serve, tokenizer: Any, detokenize: bool) -> None:
    """``prompt_logprobs: 0``: one item per prompt token, the first null,
    then ``{"<id>": {logprob, rank, decoded_token}}``; one token sampled."""
    client, _ = await serve(**VLLM, weight_version="w1")
    prompt = prompt_of(tokenizer)
    answer = await vllm_generate(client, vllm_body(prompt, detokenize=detokenize))
    items = answer["prompt_logprobs"]
    assert len(items) == len(prompt) and items[0] is None
    for item, token in zip(items[1:], prompt[1:], strict=True):
        assert list(item) == [str(token)]
        entry = item[str(token)]
        assert list(entry) == ["logprob", "rank", "decoded_token"]
        assert entry["rank"] == max(1, math.floor(math.exp(-entry["logprob"])))
        assert entry["decoded_token"] == (tokenizer.decode([token]) if detokenize else None)
    model_like([None, *(i[str(t)]["logprob"] for i, t in zip(items[1:], prompt[1:], strict=True))])
    [choice] = answer["choices"]
    assert len(choice["token_ids"]) == 1 and choice["finish_reason"] == "length"
    assert choice["weight_versions"] == [{"version": "w1", "start": 0, "end": 1}]
    assert answer["prompt_token_id_logprobs"] is None


async def test_vllm_without_prompt_logprobs_answers_null(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(**VLLM)
    body = vllm_body(prompt_of(tokenizer))
    del body["sampling_params"]["prompt_logprobs"]
    assert (await vllm_generate(client, body))["prompt_logprobs"] is None


@pytest.mark.parametrize(
    ("sampling", "stream", "param", "message"),
    [
        ({"max_tokens": 0}, False, "max_tokens", "max_tokens must be at least 1, got 0."),
        ({}, True, "stream", "the emulator does not stream"),
        ({"prompt_logprobs": 1}, False, "prompt_logprobs", "the emulator does not model top"),
        ({"prompt_logprobs": 21}, False, "prompt_logprobs", "Requested prompt logprobs of 21"),
        ({"prompt_logprobs": -2}, False, "prompt_logprobs", "prompt_logprobs must be non-neg"),
    ],
    ids=["max-tokens-0", "stream", "top-k", "over-max-logprobs", "negative"],
)
async def test_vllm_prompt_logprobs_refusals(
    serve: Serve,
    tokenizer: Any,
    sampling: dict[str, Any],
    stream: bool,
    param: str,
    message: str,
) -> None:
    """vLLM's 400s; ``stream: true`` (where vLLM silently drops the prompt
    logprobs) is the emulator's: it does not stream at all."""
    client, emulator = await serve(**VLLM)
    body = {**vllm_body(prompt_of(tokenizer), **sampling), "stream": stream}
    error = error_of(await client.post(GENERATE, json=body), 400, "BadRequestError")
    assert error["message"].startswith(message) and error["param"] == param
    assert emulator.prompt_tokens == 0


async def test_vllm_prompt_logprobs_skip_the_prefix_cache(serve: Serve, tokenizer: Any) -> None:
    """``skip_reading_prefix_cache``: nothing cached is read for a request
    with prompt logprobs."""
    client, _ = await serve(**VLLM, enable_prompt_tokens_details=True)
    prompt = prompt_of(tokenizer) * 4
    plain = vllm_body(prompt)
    del plain["sampling_params"]["prompt_logprobs"]
    await vllm_generate(client, plain)
    usage = (await vllm_generate(client, plain))["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 32
    usage = (await vllm_generate(client, vllm_body(prompt)))["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


# -- the model: both engines --------------------------------------------------------


@pytest.mark.parametrize("engine", list(SCORERS), ids=list(SCORERS))
async def test_scores_are_deterministic(serve: Serve, tokenizer: Any, engine: str) -> None:
    config, scores = SCORERS[engine]
    client, _ = await serve(**config)
    other, _ = await serve(**config)  # another worker, same model
    prompt = prompt_of(tokenizer, TOOLS)
    first = await scores(client, prompt)
    assert await scores(client, prompt) == first == await scores(other, prompt)
    model_like(first)


async def test_both_engines_score_alike(serve: Serve, tokenizer: Any) -> None:
    """The same model (seed, version) behind either engine's shape."""
    sglang, _ = await serve(seed=SEED)
    vllm, _ = await serve(**VLLM, seed=SEED)
    prompt = prompt_of(tokenizer)
    assert await sglang_scores(sglang, prompt) == await vllm_scores(vllm, prompt)


async def test_a_long_segment(serve: Serve) -> None:
    """A 20k-token segment of arbitrary ids: one entry each, every one model-like."""
    client, _ = await serve()
    ids = np.random.default_rng(0).integers(0, 100_000, 20_000).tolist()
    values = await sglang_scores(client, ids)
    assert len(values) == len(ids)
    model_like(values)
    assert len(set(values)) > 1000  # spread, not a constant


async def _sampled(
    client: httpx.AsyncClient, route: str, prompt: list[int]
) -> tuple[list[int], list[float]]:
    """An answer the emulator samples on `route`: its ids and logprobs."""
    if route == "chat":
        body = {"input_ids": prompt, "seed": SEED, "return_meta_info": True, "tools": TOOLS}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        entries = response.json()["choices"][0]["meta_info"]["output_token_logprobs"]
    elif route == "vllm":
        body = {
            "token_ids": prompt,
            "sampling_params": {"max_tokens": 200, "logprobs": 0, "seed": SEED},
        }
        content = (await vllm_generate(client, body))["choices"][0]["logprobs"]["content"]
        return [e["token_id"] for e in content], [e["logprob"] for e in content]
    else:
        sampling = {"max_new_tokens": 200 if route == "generate" else 5, "sampling_seed": SEED}
        body = {"input_ids": prompt, "return_logprob": True, "sampling_params": sampling}
        entries = (await generate(client, body))["meta_info"]["output_token_logprobs"]
    return [e[1] for e in entries], [e[0] for e in entries]


ROUTES = ["chat", "generate", "generate-cut", "vllm"]


def _scorer(route: str) -> tuple[dict[str, Any], Scorer]:
    return SCORERS["vllm" if route == "vllm" else "sglang"]


@pytest.mark.parametrize("route", ROUTES, ids=ROUTES)
@pytest.mark.parametrize("reasoning", [False, True], ids=["chatml", "qwen3-reasoning"])
async def test_rescoring_a_sampled_answer_gives_its_logprobs(
    serve: Serve, tokenizer: Any, route: str, reasoning: bool
) -> None:
    """Prompt + answer ids sent back as a prefill, on the same worker (and
    on another with the same model): the answer's positions score exactly
    the logprobs it was sampled with (drift 0)."""
    config, scores = _scorer(route)
    if reasoning:
        config = {**config, "chat_template": QWEN3, "reasoning": True}
    client, _ = await serve(**config)
    other, _ = await serve(**config)
    prompt = render(
        tokenizer,
        MESSAGES,
        tools=TOOLS,
        chat_template=QWEN3 if reasoning else None,
        add_generation_prompt=True,
    )
    ids, logprobs = await _sampled(client, route, prompt)
    assert ids
    for worker in (client, other):
        values = await scores(worker, prompt + ids)
        assert values[len(prompt) :] == logprobs


@pytest.mark.parametrize("route", ROUTES, ids=ROUTES)
@pytest.mark.parametrize("change", ["teacher", "weight-update"], ids=["teacher", "weight-update"])
async def test_another_model_scores_the_tokens_differently(
    serve: Serve, tokenizer: Any, route: str, change: str
) -> None:
    """A teacher (another seed) or the same worker after a weight update
    scores the sampled tokens differently; after the update the worker
    samples, and rescoring reproduces, the new version's logprobs."""
    config, scores = _scorer(route)
    config = {**config, "dev_mode": route == "vllm"}
    client, _ = await serve(**config)
    prompt = prompt_of(tokenizer, TOOLS)
    ids, logprobs = await _sampled(client, route, prompt)
    if change == "teacher":
        teacher, _ = await serve(**{**config, "seed": 1})
        values = await scores(teacher, prompt + ids)
    else:
        response = await client.post("/update_weight_version", json={"new_version": "v2"})
        assert response.status_code == 200, response.text
        values = await scores(client, prompt + ids)
        again, new_logprobs = await _sampled(client, route, prompt)
        assert again == ids  # the ids never depend on the version
        assert values[len(prompt) :] == new_logprobs
    model_like(values)
    assert values[len(prompt) :] != logprobs
    differ = sum(a != b for a, b in zip(values[len(prompt) :], logprobs, strict=True))
    assert differ >= len(ids) // 2
