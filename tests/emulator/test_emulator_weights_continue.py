"""The model continues its own answer: a prompt ``P + S[:k]`` (``S`` the
answer the emulator samples for ``P``, ``0 < k < len(S)``) is answered
with ``S[k:]`` on every route of both engines, so the stitched answer is
the uninterrupted one token for token, on any emulator with the same
configuration (docs/emulator.md#the-model-continues-its-own-answer). Cuts
fall in a text answer, inside a tool call and inside a ``<think>`` block;
a continuation after a real abort and a weight update is stitched back
with the versions of its tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from rollout_session.emulator.worker import Emulator, EmulatorConfig
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import MESSAGES, TOOLS
from tests.emulator.test_emulator_vllm import GENERATE, QWEN3, contract_body, prompt_ids
from tests.emulator.test_emulator_weights import STEP, Calls, decoding

SEED = 7
BIG = 4096


@dataclass(frozen=True)
class Answer:
    ids: list[int]
    logprobs: list[float]
    finish: str  # SGLang's finish_reason.type, vLLM's finish_reason
    text: str | None  # /generate's text
    body: dict[str, Any]


async def chat_answer(client: httpx.AsyncClient, prompt: list[int], budget: int) -> Answer:
    # The tools go beside the ids, as a session server sends them: SGLang's
    # chat route parses tool calls only for a request that offers tools.
    body = {
        "input_ids": prompt,
        "tools": TOOLS,
        "max_tokens": budget,
        "seed": SEED,
        "return_meta_info": True,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    meta = answer["choices"][0]["meta_info"]
    entries = meta["output_token_logprobs"]
    return Answer(
        [e[1] for e in entries],
        [e[0] for e in entries],
        meta["finish_reason"]["type"],
        None,
        answer,
    )


async def generate_answer(client: httpx.AsyncClient, prompt: list[int], budget: int) -> Answer:
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": budget, "sampling_seed": SEED},
    }
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    entries = answer["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == answer["output_ids"]
    return Answer(
        answer["output_ids"],
        [e[0] for e in entries],
        answer["meta_info"]["finish_reason"]["type"],
        answer["text"],
        answer,
    )


async def vllm_answer(client: httpx.AsyncClient, prompt: list[int], budget: int) -> Answer:
    body = contract_body(
        prompt, output_mode="tokens", sampling={"max_tokens": budget, "seed": SEED}
    )
    response = await client.post(GENERATE, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    [choice] = answer["choices"]
    logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
    finish = "length" if choice["finish_reason"] == "length" else choice["finish_reason"]
    return Answer(choice["token_ids"], logprobs, finish, None, answer)


ROUTES: dict[str, Callable[..., Any]] = {
    "chat": chat_answer,
    "generate": generate_answer,
    "vllm": vllm_answer,
}
VLLM = {"engine": "vllm", "enable_scale_out": True}


def config_for(route: str, case: str) -> dict[str, Any]:
    # SGLang workers run the templates' SGLang parsers (its chat route parses only with them).
    config: dict[str, Any] = dict(VLLM) if route == "vllm" else {"tool_call_parser": "qwen25"}
    if case == "reasoning":
        config.update(chat_template=QWEN3, reasoning=True)
        if route != "vllm":
            config["reasoning_parser"] = "qwen3"
    return config


def prompt_for(tokenizer: Any, case: str) -> list[int]:
    if case == "tool-call":
        return prompt_ids(tokenizer, tools=TOOLS)
    if case == "reasoning":
        return prompt_ids(tokenizer, chat_template=QWEN3)
    return prompt_ids(tokenizer, MESSAGES)


def cuts(case: str, ids: list[int], tokenizer: Any) -> list[int]:
    """Where to cut: the first token, the case's own place, the last but one."""

    def text(k: int) -> str:
        return str(tokenizer.decode(ids[:k]))

    if case == "tool-call":  # inside the call's JSON, after its name
        inside = next(k for k in range(1, len(ids)) if '"arguments"' in text(k))
    elif case == "reasoning":  # inside the reasoning block
        inside = next(k for k in range(1, len(ids)) if "<think>" in text(k) and len(text(k)) > 16)
        assert "</think>" not in text(inside)
    else:
        inside = len(ids) // 2
    return [1, inside, len(ids) - 1]


@pytest.mark.parametrize("case", ["text", "tool-call", "reasoning"])
@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_continuation_answers_the_rest_of_the_answer(
    serve: Serve, tokenizer: Any, route: str, case: str
) -> None:
    client, emulator = await serve(**config_for(route, case))
    ask = ROUTES[route]
    prompt = prompt_for(tokenizer, case)
    whole: Answer = await ask(client, prompt, BIG)
    if case == "tool-call":
        assert "<tool_call>" in tokenizer.decode(whole.ids)
    if case == "reasoning":
        assert tokenizer.decode(whole.ids).startswith("<think>")
    ks = cuts(case, whole.ids, tokenizer)
    for k in ks:
        rest: Answer = await ask(client, prompt + whole.ids[:k], BIG - k)
        assert rest.ids == whole.ids[k:], k
        assert rest.logprobs == whole.logprobs[k:], k
        if route == "chat" and case == "tool-call":
            # The chat route parses the continuation's text alone: the call
            # is there whole only when the cut came before its name.
            whole_message = whole.body["choices"][0]["message"]
            message = rest.body["choices"][0]["message"]
            if k == 1:
                assert message == whole_message and rest.finish == "tool_calls"
            else:
                assert "tool_calls" not in message and rest.finish == "stop"
                assert message["content"] == tokenizer.decode(rest.ids, skip_special_tokens=True)
        else:
            assert rest.finish == whole.finish
        if route == "chat" and case == "reasoning" and k == ks[1]:
            # Cut inside the reasoning: the continuation's message is the
            # rest of the reasoning, then the whole answer's content.
            whole_message = whole.body["choices"][0]["message"]
            message = rest.body["choices"][0]["message"]
            thought = whole_message["reasoning_content"]
            assert thought.endswith(message["reasoning_content"])
            assert len(message["reasoning_content"]) < len(thought)
            assert message["content"] == whole_message["content"]
        if rest.text is not None:
            head: Answer = await ask(client, prompt, k)
            assert head.text is not None and head.text + rest.text == whole.text
    assert emulator.continued == ks


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_continuation_of_a_cut_answer_keeps_the_cut(
    serve: Serve, tokenizer: Any, route: str
) -> None:
    """The first request's budget cut its answer at 6 tokens; the
    continuation after 2, with 4 left, ends where it did (length)."""
    client, _ = await serve(**config_for(route, "text"))
    ask = ROUTES[route]
    prompt = prompt_for(tokenizer, "text")
    cut: Answer = await ask(client, prompt, 6)
    assert cut.finish == "length" and len(cut.ids) == 6
    rest: Answer = await ask(client, prompt + cut.ids[:2], 4)
    assert (rest.ids, rest.logprobs, rest.finish) == (cut.ids[2:], cut.logprobs[2:], "length")


@pytest.mark.parametrize("route", list(ROUTES))
async def test_any_worker_with_the_same_config_continues_it(
    serve: Serve, tokenizer: Any, route: str
) -> None:
    """Nothing is remembered: a fresh emulator continues what another sampled."""
    first, _ = await serve(**config_for(route, "tool-call"), seed=3)
    second, emulator = await serve(**config_for(route, "tool-call"), seed=3)
    ask = ROUTES[route]
    prompt = prompt_for(tokenizer, "tool-call")
    whole: Answer = await ask(first, prompt, BIG)
    rest: Answer = await ask(second, prompt + whole.ids[:5], BIG - 5)
    assert whole.ids[:5] + rest.ids == whole.ids and emulator.continued == [5]
    other, _ = await serve(**config_for(route, "tool-call"), seed=4)
    fresh: Answer = await ask(other, prompt + whole.ids[:5], BIG - 5)
    assert fresh.ids != whole.ids[5:]  # another seed: another model's answer


@pytest.mark.parametrize(
    "tail",
    [
        lambda ids: [ids[0] + 1],  # not the answer's first token
        lambda ids: [*ids[:3], ids[3] + 1],  # diverges after three
        lambda ids: list(ids),  # the whole answer: not a proper prefix
    ],
    ids=["other-token", "diverging", "whole-answer"],
)
async def test_a_tail_that_is_not_a_proper_prefix_is_a_fresh_prompt(
    serve: Serve, tokenizer: Any, tail: Callable[[list[int]], list[int]]
) -> None:
    client, emulator = await serve()
    prompt = prompt_for(tokenizer, "text")
    whole = await generate_answer(client, prompt, BIG)
    await generate_answer(client, prompt + tail(whole.ids), 64)
    assert emulator.continued == []


async def test_parse_routes_know_the_stitched_text(serve: Serve, tokenizer: Any) -> None:
    """The session server joins the partial's text and the continuation's
    and asks SGLang's parsers: the emulator answers for the joined text."""
    client, _ = await serve()
    prompt = prompt_for(tokenizer, "tool-call")
    k = 9
    head = await generate_answer(client, prompt, k)
    rest = await generate_answer(client, prompt + head.ids, BIG - k)
    assert head.text is not None and rest.text is not None
    response = await client.post(
        "/parse_function_call",
        json={"text": head.text + rest.text, "tools": TOOLS, "tool_call_parser": "qwen25"},
    )
    assert response.status_code == 200, response.text
    assert [c["name"] for c in response.json()["calls"]] == ["read_file"]


@pytest.mark.parametrize("route", ["chat", "generate", "vllm"])
async def test_an_aborted_turn_continued_after_a_weight_update(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any, route: str
) -> None:
    """The session server's recipe: a weight update aborts the turn after 4
    tokens; the continuation (on another worker, updated too) samples the
    rest under the new weights. Stitched: the uninterrupted ids; the first
    4 logprobs v1's, the rest v2's (the model's under v2), and spans to match."""
    autojump_clock.autojump_threshold = 0.02
    latency = {"decode_s_per_token": STEP, "weight_version": "v1", "dev_mode": route == "vllm"}
    config = {**config_for(route, "tool-call"), **latency}
    client, emulator = await serve(**config)
    other, _ = await serve(**config)
    ask = ROUTES[route]
    prompt = prompt_for(tokenizer, "tool-call")
    whole: Answer = await ask(client, prompt, BIG)
    key = "generate-tokens-0123456789abcdef0123456789abcdef" if route == "vllm" else "cut"
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        if route == "vllm":
            calls.start("cut", lambda: ask(client, prompt, BIG))
        else:
            calls.start("cut", lambda: _sglang_with_rid(client, route, prompt))
        await decoding(emulator, key)
        await trio.sleep(3.5 * STEP)
        await _update(client, route, "v2", abort=True)
    cut: Answer = calls.answers["cut"]
    assert cut.finish == "abort"
    k = len(cut.ids)
    assert k == (3 if route == "vllm" else 4) and cut.ids == whole.ids[:k]
    assert cut.logprobs[:3] == whole.logprobs[:3]
    await _update(other, route, "v2", abort=False)
    rest: Answer = await ask(other, prompt + cut.ids, BIG - k)
    assert cut.ids + rest.ids == whole.ids
    v2 = emulator.logprob_model.score([*prompt, *whole.ids], "v2", len(prompt) + k)
    assert rest.logprobs == v2.logprobs() != whole.logprobs[k:]
    if route == "vllm":
        [choice] = rest.body["choices"]
        assert choice["weight_versions"] == [{"version": "v2", "start": 0, "end": len(rest.ids)}]
    else:
        meta = rest.body["choices"][0]["meta_info"] if route == "chat" else rest.body["meta_info"]
        assert meta["weight_version"] == "v2"


async def _sglang_with_rid(client: httpx.AsyncClient, route: str, prompt: list[int]) -> Answer:
    if route == "chat":
        body = {"input_ids": prompt, "max_tokens": BIG, "seed": SEED, "rid": "cut"}
        response = await client.post(
            "/v1/chat/completions", json={**body, "return_meta_info": True}
        )
        meta = response.json()["choices"][0]["meta_info"]
    else:
        body = {
            "input_ids": prompt,
            "rid": "cut",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": BIG, "sampling_seed": SEED},
        }
        response = await client.post("/generate", json=body)
        meta = response.json()["meta_info"]
    entries = meta["output_token_logprobs"]
    return Answer(
        [e[1] for e in entries],
        [e[0] for e in entries],
        meta["finish_reason"]["type"],
        None,
        response.json(),
    )


async def _update(client: httpx.AsyncClient, route: str, version: str, *, abort: bool) -> None:
    """A weight update: SGLang's /update_weight_version (aborting), vLLM's
    /pause (abort mode when aborting), /update_weight_version, /resume."""
    if route != "vllm":
        body = {"new_version": version, "abort_all_requests": abort}
        assert (await client.post("/update_weight_version", json=body)).status_code == 200
        return
    await client.post("/pause", params={"mode": "abort" if abort else "keep"})
    await client.post("/update_weight_version", json={"new_version": version})
    await client.post("/resume")


@pytest.mark.parametrize(
    ("template", "ending", "split"),
    [
        (None, "<|im_start|>assistant\n", False),
        (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        (None, "<|im_start|>assistant\nread the", True),
        (None, "no generation prompt at all", False),
    ],
    ids=["fresh-turn", "no-think-variant", "continuation", "none"],
)
def test_split_points_come_from_the_generation_prompts(
    model: Any, tokenizer: Any, template: str | None, ending: str, split: bool
) -> None:
    """A prompt ending with a generation prompt (any thinking variant) is a
    fresh turn: no candidate. One with text after the last is a candidate
    continuation, split where that generation prompt ends."""
    emulator = Emulator(EmulatorConfig(chat_template=template), model=model)
    head = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    prompt = head + tokenizer.encode(ending, add_special_tokens=False)
    points = emulator.generation_prompts.split_points(prompt)
    if not split:
        assert points == []
    else:
        [point] = points
        assert tokenizer.decode(prompt[point:]) == "read the"
