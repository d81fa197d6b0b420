"""The emulator as a vLLM 0.33 worker, over real sockets: its routes (and
none of SGLang's), the 403 without --enable-scale-out, every refusal of
``POST /inference/v1/generate`` in vLLM's error shapes, the three answer
shapes field by field, derender with and without parsers, routed experts,
weight versions, prompt-token details, aborts and every fault
(docs/emulator.md, vLLM mode)."""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import trio
from transformers import AutoTokenizer

from rollout_session.emulator.cli import add_arguments, config_from_args
from rollout_session.emulator.config import EmulatorConfig
from rollout_session.emulator.faults import FAULT_HEADER, FAULTS
from rollout_session.emulator.model.prompt_reader import ALL_TOOLS
from rollout_session.emulator.model.routed_experts import routed_experts
from rollout_session.emulator.tokenizer import builtin_template
from rollout_session.emulator.worker import Emulator
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import MESSAGES, TOOLS, render

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
VOCAB = 129278  # the bundled tokenizer's max id + 1
QWEN3 = builtin_template("qwen3")
VLLM: dict[str, Any] = {"engine": "vllm", "enable_scale_out": True}
ERROR_KEYS = ["message", "type", "param", "code"]
RESPONSE_KEYS = [
    "request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
    "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params",
    "output_mode", "choices",
]  # fmt: skip
CHOICE_BASE = [
    "index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
    "weight_versions",
]  # fmt: skip
USAGE_KEYS = [
    "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
    "completion_tokens_details",
]  # fmt: skip
MESSAGE_KEYS = ["role", "content", "refusal", "annotations", "audio", "function_call"]
NAMED = {"type": "function", "function": {"name": "list_dir"}}
ASK_ALL = [MESSAGES[0], {"role": "user", "content": f"List the files; {ALL_TOOLS}."}]


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]] = MESSAGES, **kw: Any) -> list[int]:
    return render(tokenizer, messages, add_generation_prompt=True, **kw)


def contract_body(token_ids: list[int], **overrides: Any) -> dict[str, Any]:
    """The body the session server's vLLM engine sends (its contract)."""
    sampling: dict[str, Any] = {
        "n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "max_tokens": None, "min_tokens": 0, "stop": [], "stop_token_ids": [],
        "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "include_stop_str_in_output": False, "logprobs": 0, "seed": 7,
        "structured_outputs": None,
    }  # fmt: skip
    sampling.update(overrides.pop("sampling", {}))
    body: dict[str, Any] = {
        "request_id": "0123456789abcdef0123456789abcdef",
        "token_ids": token_ids,
        "model": "rollout-session/emulator",
        "output_mode": "derender",
        "stream": False,
        "sampling_params": sampling,
        "parse_context": {
            "tools": None,
            "tool_choice": "none",
            "parallel_tool_calls": True,
            "include_reasoning": True,
            "chat_template_kwargs": {},
            "history_tool_call_cnt": 0,
        },
    }
    body["parse_context"].update(overrides.pop("parse_context", {}))
    body.update(overrides)
    return body


async def generate(
    client: httpx.AsyncClient, body: dict[str, Any], **headers: str
) -> dict[str, Any]:
    response = await client.post(GENERATE, json=body, headers=headers)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def error_of(response: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    """vLLM's ErrorResponse: {"error": {message, type, param, code}}, code = status."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and list(body["error"]) == ERROR_KEYS, body
    error: dict[str, Any] = body["error"]
    assert (error["type"], error["code"]) == (type_, status), error
    return error


# -- routes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [GENERATE, ABORT, "/v1/chat/completions/render", "/v1/completions/derender"],
    ids=["generate", "abort", "render", "derender"],
)
async def test_scale_out_paths_are_403_without_the_flag(serve: Serve, path: str) -> None:
    client, emulator = await serve(engine="vllm")
    response = await client.post(path, json={"token_ids": [1], "sampling_params": {}})
    error = error_of(response, 403, "PermissionDeniedError")
    assert error["message"] == (
        "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
        "enable them."
    )
    assert error["param"] is None
    assert emulator.received == 0


async def test_it_serves_vllm_routes_and_none_of_sglang(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(**VLLM, model_name="m/one", context_length=4096)
    health = await client.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    assert (await client.get("/version")).json() == {"version": "0.33.0"}
    assert (await client.get("/load")).json() == {"server_load": 0}
    models = (await client.get("/v1/models")).json()
    assert list(models) == ["object", "data"] and models["object"] == "list"
    [card] = models["data"]
    assert list(card) == [
        "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission",
    ]  # fmt: skip
    assert (card["id"], card["object"], card["owned_by"]) == ("m/one", "model", "vllm")
    assert (card["parent"], card["max_model_len"]) == (None, 4096)
    # root is the model path: the session server loads the tokenizer from it.
    assert len(AutoTokenizer.from_pretrained(card["root"])) == len(tokenizer)
    [permission] = card["permission"]
    assert permission["id"].startswith("modelperm-") and len(permission["id"]) == 26
    assert permission["object"] == "model_permission" and permission["allow_logprobs"] is True
    for path in ("/get_model_info", "/server_info"):
        missing = await client.get(path)
        assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    sglang_generate = await client.post("/generate", json={"input_ids": [1, 2]})
    assert sglang_generate.status_code == 404
    chat = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert "does not model" in error_of(chat, 501, "NotImplementedError")["message"]
    wrong_method = await client.get(GENERATE)
    assert (wrong_method.status_code, wrong_method.json()) == (
        405,
        {"detail": "Method Not Allowed"},
    )


# -- the answer --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["tokens", "text", "derender"])
async def test_answer_shape_and_field_order(serve: Serve, tokenizer: Any, mode: str) -> None:
    client, emulator = await serve(**VLLM, weight_version="w3")
    prompt = prompt_ids(tokenizer)
    body = contract_body(prompt, output_mode=mode)
    answer = await generate(client, body, **{"X-Session-ID": "s-1", "x-smg-routing-key": "s-1"})
    assert list(answer) == RESPONSE_KEYS
    assert answer["request_id"] == "generate-tokens-0123456789abcdef0123456789abcdef"
    assert answer["model"] == "rollout-session/emulator" and answer["output_mode"] == mode
    assert isinstance(answer["created"], int)
    for key in RESPONSE_KEYS[4:11]:
        assert answer[key] is None, key
    [choice] = answer["choices"]
    extra = {
        "tokens": ["logprobs"],
        "text": ["text", "logprobs"],
        "derender": ["message", "logprobs"],
    }
    assert list(choice) == CHOICE_BASE + extra[mode]
    ids = choice["token_ids"]
    n = len(ids)
    assert ids[-1] == tokenizer.eos_token_id
    assert (choice["index"], choice["finish_reason"], choice["stop_reason"]) == (0, "stop", None)
    assert choice["routed_experts"] is None and choice["sampling_mask"] is None
    assert choice["weight_versions"] == [{"version": "w3", "start": 0, "end": n}]
    usage = answer["usage"]
    assert list(usage) == USAGE_KEYS
    assert usage == {
        "prompt_tokens": len(prompt), "total_tokens": len(prompt) + n, "completion_tokens": n,
        "prompt_tokens_details": None, "completion_tokens_details": None,
    }  # fmt: skip
    entries = choice["logprobs"]["content"]
    assert list(choice["logprobs"]) == ["content"] and len(entries) == n
    text = tokenizer.decode(ids[:-1], skip_special_tokens=True)
    if mode == "tokens":
        assert list(entries[0]) == ["token_id", "logprob", "rank", "top_logprobs"]
        assert [e["token_id"] for e in entries] == ids
        assert entries[0]["top_logprobs"] == [
            {k: entries[0][k] for k in ("token_id", "logprob", "rank")}
        ]
    else:
        assert list(entries[0]) == ["token", "logprob", "bytes", "top_logprobs"]
        assert [e["token"] for e in entries] == [tokenizer.decode([t]) for t in ids]
        assert entries[-1]["token"] == "<|im_end|>"
        assert entries[-1]["bytes"] == list(b"<|im_end|>")
        top = entries[0]["top_logprobs"]
        # text keeps every candidate (the sampled token); derender the chat cut (0: none).
        assert top == (
            [{k: entries[0][k] for k in ("token", "logprob", "bytes")}] if mode == "text" else []
        )
    assert all(math.isfinite(e["logprob"]) and e["logprob"] < 0 for e in entries)
    if mode == "text":
        assert choice["text"] == text
    if mode == "derender":
        message = choice["message"]
        assert list(message) == [*MESSAGE_KEYS, "reasoning"]
        assert message["content"] == text and message["reasoning"] is None
    record = emulator.requests[-1]
    assert (record.route, record.session_id) == ("vllm-generate", "s-1")
    assert record.headers["x-smg-routing-key"] == "s-1"


async def test_samples_what_sglang_generate_samples(serve: Serve, tokenizer: Any) -> None:
    """Same prompt ids, seed and budget: the same ids and logprobs as SGLang's /generate."""
    sglang, _ = await serve(chat_template=QWEN3, reasoning=True)
    vllm, _ = await serve(**VLLM, chat_template=QWEN3, reasoning=True)
    prompt = prompt_ids(tokenizer, chat_template=QWEN3)
    for budget in (None, 6):
        by_sglang = await sglang.post(
            "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"sampling_seed": 9, "max_new_tokens": budget},
                "return_logprob": True,
            },
        )
        meta = by_sglang.json()["meta_info"]
        sampling = {"seed": 9, "max_tokens": budget}
        answer = await generate(
            vllm, contract_body(prompt, output_mode="tokens", sampling=sampling)
        )
        [choice] = answer["choices"]
        assert choice["token_ids"] == by_sglang.json()["output_ids"]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == [
            e[0] for e in meta["output_token_logprobs"]
        ]
        assert choice["finish_reason"] == ("stop" if budget is None else "length")


async def test_engine_contract_headers_and_request_id(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(**VLLM)
    prompt = prompt_ids(tokenizer)
    answer = await generate(client, contract_body(prompt), **{"X-Request-Id": "hdr-1"})
    assert answer["request_id"] == "generate-tokens-hdr-1"
    body = contract_body(prompt)
    del body["request_id"], body["model"]  # a random 16-hex id; any model
    answer = await generate(client, body)
    assert len(answer["request_id"]) == len("generate-tokens-") + 16
    shown = await generate(client, contract_body(prompt, return_token_ids=True))
    assert shown["prompt_token_ids"] == prompt
    # Unknown keys are dropped by pydantic, at the top level and in sampling_params.
    body = contract_body(prompt, future_field=1, sampling={"future_knob": True}, priority=5)
    body["reasoning_parser_kwargs"] = {"chat_template_kwargs": {"enable_thinking": False}}
    await generate(client, body)


# -- max_tokens and the context ------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({}, ("length", "room")),  # omitted: min(context - prompt, ...)
        ({"max_tokens": None}, ("length", "room")),  # explicit null: uncapped
        ({"max_tokens": 10_000}, ("length", "room")),  # larger than the room: stops at the context
        ({"max_tokens": 3}, ("length", 3)),
    ],
    ids=["omitted", "null", "over-the-room", "three"],
)
async def test_max_tokens_semantics(
    serve: Serve, tokenizer: Any, sampling: dict[str, Any], expected: tuple[str, Any]
) -> None:
    client, _ = await serve(**VLLM, context_length=64, completion_tokens=61)
    prompt = prompt_ids(tokenizer)
    room = 64 - len(prompt)
    body = {"token_ids": prompt, "sampling_params": sampling, "output_mode": "text"}
    [choice] = (await generate(client, body))["choices"]
    reason, count = expected
    assert choice["finish_reason"] == reason and choice["stop_reason"] is None
    assert len(choice["token_ids"]) == (room if count == "room" else count)
    assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)


@pytest.mark.parametrize(
    ("extra", "length", "message"),
    [
        ({}, 65, "Input length (65) exceeds model's maximum context length (64)."),
        (
            {"max_tokens": 4},
            65,
            "The decoder prompt (length 65) is longer than the maximum model length of 64. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens.",
        ),
        (
            {},
            64,
            "The decoder prompt (length 64) plus the number of requested output tokens (at "
            "least 1) is longer than the maximum model length of 64. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
            "output tokens).",
        ),
    ],
    ids=["omitted-max-tokens", "explicit-max-tokens", "prompt-equals-context"],
)
async def test_prompt_over_the_context_is_refused(
    serve: Serve, extra: dict[str, Any], length: int, message: str
) -> None:
    client, emulator = await serve(**VLLM, context_length=64)
    body = {"token_ids": list(range(100, 100 + length)), "sampling_params": extra}
    error = error_of(await client.post(GENERATE, json=body), 400, "BadRequestError")
    assert (error["message"], error["param"]) == (message, None)
    assert emulator.completed == 1 and emulator.prompt_tokens == 0


# -- refusals ----------------------------------------------------------------------

OK_PROMPT = [100, 101, 102]


def _body(**overrides: Any) -> dict[str, Any]:
    sampling = overrides.pop("sampling", {})
    return {"token_ids": OK_PROMPT, "sampling_params": sampling, **overrides}


# (body, status, type, param, message or message prefix)
REFUSALS: dict[str, tuple[Any, int, str, str | None, str]] = {
    "no-token-ids": (
        {"sampling_params": {}}, 400, "Bad Request", "body.token_ids",
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.token_ids', 'msg': 'Field "
        "required', 'input': '<dict of 1 items>'}",
    ),
    "empty-token-ids": (
        _body(token_ids=[]), 400, "Bad Request", "body.token_ids",
        "1 validation error:\n  {'type': 'too_short', 'loc': 'body.token_ids', 'msg': 'List "
        "should have at least 1 item after validation, not 0', 'input': '<list of 0 items>', "
        "'ctx': {'field_type': 'List', 'min_length': 1, 'actual_length': 0}}",
    ),
    "negative-id": (
        _body(token_ids=[5, -1]), 400, "Bad Request", "body.token_ids",
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body.token_ids', 'msg': 'Value "
        "error, token_ids must not contain negative values', 'input': '<list of 2 items>', "
        "'ctx': {'error': ValueError('token_ids must not contain negative values')}}",
    ),
    "string-id": (
        _body(token_ids=[5, "x"]), 400, "Bad Request", "body.token_ids.1",
        "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.token_ids.1'",
    ),
    "no-sampling-params": (
        {"token_ids": OK_PROMPT}, 400, "Bad Request", "body.sampling_params",
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.sampling_params'",
    ),
    "out-of-vocab-id": (
        _body(token_ids=[5, VOCAB]), 400, "BadRequestError", None,
        f"Token id {VOCAB} is out of vocabulary",
    ),
    "bad-output-mode": (
        _body(output_mode="chat"), 400, "Bad Request", "body.output_mode",
        "1 validation error:\n  {'type': 'literal_error', 'loc': 'body.output_mode', 'msg': "
        "\"Input should be 'tokens', 'text' or 'derender'\"",
    ),
    "text-without-detokenize": (
        _body(output_mode="text", sampling={"detokenize": False}), 400, "Bad Request", "body",
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': \"Value error, "
        "output_mode='text' requires sampling_params.detokenize to be true\"",
    ),
    "stream": (
        _body(stream=True), 400, "BadRequestError", "stream",
        "the emulator does not stream: send stream: false",
    ),
    "derender-stream": (
        _body(stream=True, output_mode="derender"), 400, "BadRequestError", None,
        "output_mode='derender' does not support stream=true.",
    ),
    "unknown-model": (
        _body(model="other"), 404, "NotFoundError", "model",
        "The model `other` does not exist. Valid aliases: rollout-session/emulator.",
    ),
    "n-0": (_body(sampling={"n": 0}), 400, "BadRequestError", None, "n must be at least 1, got 0."),
    "n-2": (
        _body(sampling={"n": 2}), 400, "BadRequestError", "n",
        "the emulator does not model n > 1",
    ),
    "temperature": (
        _body(sampling={"temperature": 2.5}), 400, "BadRequestError", "temperature",
        "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",
    ),
    "negative-temperature": (
        _body(sampling={"temperature": -1}), 400, "BadRequestError", "temperature",
        "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
    ),
    "top-p": (
        _body(sampling={"top_p": 0}), 400, "BadRequestError", "top_p",
        "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)",
    ),
    "top-k": (
        _body(sampling={"top_k": -2}), 400, "BadRequestError", None,
        "top_k must be 0 (disable), or at least 1, got -2.",
    ),
    "min-p": (
        _body(sampling={"min_p": 1.5}), 400, "BadRequestError", None,
        "min_p must be in [0, 1], got 1.5.",
    ),
    "presence-penalty": (
        _body(sampling={"presence_penalty": 3}), 400, "BadRequestError", None,
        "presence_penalty must be in [-2, 2], got 3.0.",
    ),
    "frequency-penalty": (
        _body(sampling={"frequency_penalty": -3}), 400, "BadRequestError", None,
        "frequency_penalty must be in [-2, 2], got -3.0.",
    ),
    "repetition-penalty": (
        _body(sampling={"repetition_penalty": 0}), 400, "BadRequestError", None,
        "repetition_penalty must be greater than zero, got 0.0.",
    ),
    "max-tokens-0": (
        _body(sampling={"max_tokens": 0}), 400, "BadRequestError", "max_tokens",
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
    ),
    "min-tokens-negative": (
        _body(sampling={"min_tokens": -1}), 400, "BadRequestError", None,
        "min_tokens must be greater than or equal to 0, got -1.",
    ),
    "min-over-max-tokens": (
        _body(sampling={"min_tokens": 5, "max_tokens": 4}), 400, "BadRequestError", None,
        "min_tokens must be less than or equal to max_tokens=4, got 5.",
    ),
    "logprobs-negative": (
        _body(sampling={"logprobs": -2}), 400, "BadRequestError", "logprobs",
        "logprobs must be non-negative or -1, got -2. (parameter=logprobs, value=-2)",
    ),
    "logprobs-21": (
        _body(sampling={"logprobs": 21}), 400, "BadRequestError", "logprobs",
        "Requested sample logprobs of 21, which is greater than max allowed: 20 "
        "(parameter=logprobs, value=21)",
    ),
    "logprobs-all": (
        _body(sampling={"logprobs": -1}), 400, "BadRequestError", "logprobs",
        f"Requested sample logprobs of {VOCAB}, which is greater than max allowed: 20",
    ),
    "top-logprobs": (
        _body(sampling={"logprobs": 5}), 400, "BadRequestError", "logprobs",
        "the emulator does not model top logprobs",
    ),
    "greedy-n": (
        _body(sampling={"temperature": 0, "n": 2}), 400, "BadRequestError", None,
        "n must be 1 when using greedy sampling, got 2.",
    ),
    "empty-stop": (
        _body(sampling={"stop": ["a", ""]}), 400, "BadRequestError", None,
        "stop cannot contain an empty string.",
    ),
    "stop-token-out-of-vocab": (
        _body(sampling={"stop_token_ids": [VOCAB + 1]}), 400, "BadRequestError",
        "stop_token_ids",
        f"token_id(s) [{VOCAB + 1}] in stop_token_ids contain out-of-vocab token ids. "
        f"Vocabulary size: {VOCAB}",
    ),
    "logit-bias-out-of-vocab": (
        _body(sampling={"logit_bias": {"5": 1.0, str(VOCAB): 2.0}}), 400, "BadRequestError",
        "logit_bias",
        f"token_id(s) [{VOCAB}] in logit_bias contain out-of-vocab token ids.",
    ),
    # SamplingParams reaches pydantic as PydanticMsgspecMixin's union (an
    # instance | its typed dict): a bad field fails both branches.
    "temperature-type": (
        _body(sampling={"temperature": "hot"}), 400, "Bad Request", "body.sampling_params",
        "2 validation errors:\n  {'type': 'is_instance_of', 'loc': 'body.sampling_params', "
        "'msg': 'Input should be an instance of SamplingParams', 'input': '<dict of 1 items>', "
        "'ctx': {'class': 'SamplingParams'}}\n  {'type': 'float_parsing', "
        "'loc': 'body.sampling_params.temperature'",
    ),
    "routed-experts-start": (
        _body(sampling={"routed_experts_prompt_start": 4}), 400, "BadRequestError",
        "routed_experts_prompt_start",
        "routed_experts_prompt_start must be between 0 and the prompt length (3), inclusive. "
        "(parameter=routed_experts_prompt_start, value=4)",
    ),
    "two-constraints": (
        _body(sampling={"structured_outputs": {"json": {}, "json_object": True}}), 400,
        "BadRequestError", None,
        "You can only use one kind of structured outputs constraint but multiple are "
        "specified: {'json': {}, 'regex': None",
    ),
    "json-object-false": (
        _body(sampling={"structured_outputs": {"json_object": False}}), 400, "BadRequestError",
        None,
        "structured_outputs.json_object must be True if set; omit structured_outputs to "
        "disable structured outputs",
    ),
    "structural-tag": (
        _body(sampling={"structured_outputs": {"structural_tag": "{}"}}), 400,
        "BadRequestError", "structured_outputs",
        "the emulator does not model structured_outputs.structural_tag",
    ),
    "regex": (
        _body(sampling={"structured_outputs": {"regex": "a+"}}), 400, "BadRequestError",
        "structured_outputs", "the emulator does not model structured_outputs.regex",
    ),
    "grammar": (
        _body(sampling={"structured_outputs": {"grammar": "root ::= 'a'"}}), 400,
        "BadRequestError", "structured_outputs",
        "the emulator does not model structured_outputs.grammar",
    ),
    "choice": (
        _body(sampling={"structured_outputs": {"choice": ["a"]}}), 400, "BadRequestError",
        "structured_outputs", "the emulator does not model structured_outputs.choice",
    ),
    "ignore-eos": (
        _body(sampling={"ignore_eos": True}), 400, "BadRequestError", "ignore_eos",
        "the emulator does not model ignore_eos",
    ),
    "top-prompt-logprobs": (
        _body(sampling={"prompt_logprobs": 2}), 400, "BadRequestError", "prompt_logprobs",
        "the emulator does not model top prompt logprobs",
    ),
    "all-prompt-logprobs": (
        _body(sampling={"prompt_logprobs": -1}), 400, "BadRequestError", "prompt_logprobs",
        "Requested prompt logprobs of",
    ),
    "bad-words": (
        _body(sampling={"bad_words": ["x"]}), 400, "BadRequestError", "bad_words",
        "the emulator does not model sampling_params.bad_words",
    ),
    "cache-salt": (
        _body(cache_salt="a/b"), 400, "BadRequestError", "cache_salt",
        "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', "
        "'/', '\\\\', or NUL. (parameter=cache_salt)",
    ),
    "priority-range": (
        _body(priority=2**63), 400, "Bad Request", "body.priority",
        "1 validation error:\n  {'type': 'less_than_equal', 'loc': 'body.priority'",
    ),
    "parse-context-unknown-field": (
        _body(output_mode="derender", parse_context={"tool_choice": "none", "newer": 1}), 400,
        "Bad Request", "body",
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': \"Value error, "
        "Unknown parse_context fields ['newer']; the render server is newer than this "
        "generate server\"",
    ),
    "reasoning-parser-kwargs-extra": (
        _body(reasoning_parser_kwargs={"other": 1}), 400, "Bad Request",
        "body.reasoning_parser_kwargs.other",
        "1 validation error:\n  {'type': 'extra_forbidden'",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS.values()), ids=list(REFUSALS))
async def test_refusals_in_vllm_shapes(
    serve: Serve, case: tuple[Any, int, str, str | None, str]
) -> None:
    body, status, type_, param, message = case
    client, emulator = await serve(**VLLM)
    error = error_of(await client.post(GENERATE, json=body), status, type_)
    assert error["message"].startswith(message), error["message"]
    assert error["param"] == param
    assert emulator.received == emulator.completed == 1
    assert emulator.prompt_tokens == 0  # nothing was served


@pytest.mark.parametrize(
    ("content", "raw", "message"),
    [
        ("text/plain", b"{}", "1 validation error:\n  Unsupported Media Type: Only "
         "'application/json' is allowed"),
        ("application/json", b"{nope", "1 validation error:\n  {'type': 'json_invalid', "
         "'loc': 'body.1', 'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
         "'ctx': {'error': 'Expecting property name enclosed in double quotes'}}"),
    ],
    ids=["media-type", "malformed-json"],
)  # fmt: skip
async def test_body_that_is_not_json_is_refused(
    serve: Serve, content: str, raw: bytes, message: str
) -> None:
    client, _ = await serve(**VLLM)
    response = await client.post(GENERATE, content=raw, headers={"content-type": content})
    assert error_of(response, 400, "Bad Request")["message"] == message


PARSERS = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}


@pytest.mark.parametrize(
    ("parse_context", "message", "param"),
    [
        (
            None,
            "output_mode='derender' requires parse_context on a server with a tool or "
            "reasoning parser. Use the one returned by /render.",
            None,
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "The tool specified in `tool_choice` does not match any of the specified `tools` "
            "(parameter=tool_choice)",
            "tool_choice",
        ),
    ],
    ids=["no-parse-context", "named-tool-not-in-tools"],
)
async def test_derender_on_a_parser_server_needs_a_valid_parse_context(
    serve: Serve, parse_context: Any, message: str, param: str | None
) -> None:
    client, _ = await serve(**VLLM, **PARSERS)
    body = _body(output_mode="derender", parse_context=parse_context)
    error = error_of(await client.post(GENERATE, json=body), 400, "BadRequestError")
    assert (error["message"], error["param"]) == (message, param)


# -- derender ------------------------------------------------------------------------


async def test_derender_without_a_parser_is_the_whole_text(serve: Serve, tokenizer: Any) -> None:
    """No parser: the content is the decoded text (reasoning markup and tool
    calls included), parse_context ignored entirely."""
    client, _ = await serve(**VLLM, chat_template=QWEN3, reasoning=True)
    prompt = prompt_ids(tokenizer, tools=TOOLS, chat_template=QWEN3)
    for skip in (True, False):
        body = contract_body(
            prompt,
            sampling={"skip_special_tokens": skip},
            parse_context={"tools": TOOLS, "tool_choice": "auto", "include_reasoning": False},
        )
        [choice] = (await generate(client, body))["choices"]
        message = choice["message"]
        ids = choice["token_ids"]
        assert message["content"] == tokenizer.decode(ids[:-1], skip_special_tokens=skip)
        assert "<tool_call>" in message["content"] and "<think>" in message["content"]
        assert "tool_calls" not in message and message["reasoning"] is None
        assert choice["finish_reason"] == "stop" and choice["logprobs"] is not None


async def test_reasoning_parser_splits_the_reasoning(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(
        **VLLM, chat_template=QWEN3, reasoning=True, reasoning_parser="qwen3", completion_tokens=30
    )
    prompt = prompt_ids(tokenizer, chat_template=QWEN3)
    [choice] = (await generate(client, contract_body(prompt)))["choices"]
    message = choice["message"]
    assert list(message) == [*MESSAGE_KEYS, "reasoning"] and "reasoning_content" not in message
    text = tokenizer.decode(choice["token_ids"][:-1], skip_special_tokens=True)
    assert message["reasoning"] and f"<think>\n{message['reasoning']}\n</think>" in text
    assert message["content"] and text.endswith(message["content"])
    # include_reasoning false hides the reasoning and the per-token metadata.
    hidden = contract_body(prompt, parse_context={"include_reasoning": False})
    [quiet] = (await generate(client, hidden))["choices"]
    assert quiet["message"]["reasoning"] is None
    assert quiet["message"]["content"] == message["content"]
    assert (quiet["token_ids"], quiet["logprobs"]) == (None, None)
    assert quiet["weight_versions"] == choice["weight_versions"]
    # Cut inside the reasoning: all of it is reasoning, no content.
    cut = contract_body(prompt, sampling={"max_tokens": 4})
    [partial] = (await generate(client, cut))["choices"]
    assert partial["finish_reason"] == "length"
    assert partial["message"]["content"] is None
    assert partial["message"]["reasoning"]
    assert message["reasoning"].startswith(partial["message"]["reasoning"])


_TOOLS: list[dict[str, Any]] = json.loads(json.dumps(TOOLS))


def tool_json_schema(choice: Any, parallel: bool = True) -> dict[str, Any]:
    """tool_parsers/utils.py get_json_schema_from_tools: "required" or a named tool."""
    if choice == "required":
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [
                    {
                        "properties": {
                            "name": {"type": "string", "enum": [t["function"]["name"]]},
                            "parameters": t["function"]["parameters"],
                        },
                        "required": ["name", "parameters"],
                    }
                    for t in _TOOLS
                ],
            },
        }
        if not parallel:
            schema["maxItems"] = 1
        return schema
    [tool] = [t for t in _TOOLS if t["function"]["name"] == choice["function"]["name"]]
    parameters: dict[str, Any] = tool["function"]["parameters"]
    return parameters


# (messages, parse_context overrides, structured_outputs, names called, content, finish)
TOOL_CASES: dict[str, tuple[Any, dict[str, Any], Any, tuple[str, ...], Any, str]] = {
    "auto": (MESSAGES, {"tool_choice": "auto"}, None, ("read_file",), None, "tool_calls"),
    "auto-parallel": (
        ASK_ALL, {"tool_choice": "auto"}, None, ("read_file", "list_dir"), None, "tool_calls",
    ),
    "auto-parallel-false": (
        ASK_ALL, {"tool_choice": "auto", "parallel_tool_calls": False}, None, ("read_file",),
        None, "tool_calls",
    ),
    "required": (
        MESSAGES, {"tool_choice": "required"}, {"json": tool_json_schema("required")},
        ("read_file",), "", "tool_calls",
    ),
    "named": (
        MESSAGES, {"tool_choice": NAMED}, {"json": json.dumps(tool_json_schema(NAMED))},
        ("list_dir",), "", "stop",
    ),
    "none": (MESSAGES, {"tool_choice": "none"}, None, (), "markup", "stop"),
    "null-tool-choice": (MESSAGES, {"tool_choice": None}, None, (), None, "stop"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TOOL_CASES.values()), ids=list(TOOL_CASES))
async def test_tool_parser_reports_the_sampled_calls(
    serve: Serve, tokenizer: Any, case: tuple[Any, dict[str, Any], Any, tuple[str, ...], Any, str]
) -> None:
    messages, context, structured, called, content, finish_reason = case
    client, _ = await serve(**VLLM, tool_call_parser="hermes")
    prompt = prompt_ids(tokenizer, messages, tools=TOOLS)
    body = contract_body(
        prompt,
        sampling={"structured_outputs": structured, "skip_special_tokens": False},
        parse_context={"tools": TOOLS, **context},
    )
    [choice] = (await generate(client, body))["choices"]
    message = choice["message"]
    calls = message.get("tool_calls", [])
    assert tuple(c["function"]["name"] for c in calls) == called
    for call in calls:
        assert list(call) == ["id", "type", "function"] and call["type"] == "function"
        assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) == 14 + 16
        json.loads(call["function"]["arguments"])
    if calls:
        assert list(message) == [*MESSAGE_KEYS, "tool_calls", "reasoning"]
    if content == "markup":
        assert "<tool_call>" in message["content"]
    else:
        assert message["content"] == content
    assert choice["finish_reason"] == finish_reason and choice["stop_reason"] is None


async def test_reasoning_and_tool_parsers_together(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(**VLLM, chat_template=QWEN3, reasoning=True, **PARSERS)
    prompt = prompt_ids(tokenizer, tools=TOOLS, chat_template=QWEN3)
    context = {"tools": TOOLS, "tool_choice": "auto"}
    body = contract_body(prompt, sampling={"skip_special_tokens": False}, parse_context=context)
    [choice] = (await generate(client, body))["choices"]
    message = choice["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["read_file"]
    assert message["content"] is None and message["reasoning"]
    assert choice["finish_reason"] == "tool_calls"
    text = tokenizer.decode(choice["token_ids"][:-1])
    assert f"<think>\n{message['reasoning']}\n</think>" in text and "<tool_call>" in text


async def test_kimi_ids_count_from_the_history(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(**VLLM, tool_call_parser="kimi_k2")
    prompt = prompt_ids(tokenizer, ASK_ALL, tools=TOOLS)
    context = {"tools": TOOLS, "tool_choice": "auto", "history_tool_call_cnt": 3}
    [choice] = (await generate(client, contract_body(prompt, parse_context=context)))["choices"]
    ids = [c["id"] for c in choice["message"]["tool_calls"]]
    assert ids == ["functions.read_file:3", "functions.list_dir:4"]


# -- generation ends: stop strings, stop ids, min_tokens ------------------------------


async def test_stop_strings_and_stop_token_ids(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(**VLLM, completion_tokens=40)
    prompt = prompt_ids(tokenizer)
    [full] = (await generate(client, contract_body(prompt, output_mode="text")))["choices"]
    words = full["text"].split(" ")
    stop = f" {words[3]}"
    for include in (False, True):
        sampling: dict[str, Any] = {"stop": [stop], "include_stop_str_in_output": include}
        [cut] = (
            await generate(client, contract_body(prompt, output_mode="text", sampling=sampling))
        )["choices"]
        at = full["text"].index(stop)
        assert cut["text"] == full["text"][: at + (len(stop) if include else 0)]
        assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop)
        assert full["token_ids"][: len(cut["token_ids"])] == cut["token_ids"]
        # The token completing the stop string is the last one kept.
        assert stop in tokenizer.decode(cut["token_ids"])
        assert stop not in tokenizer.decode(cut["token_ids"][:-1])
    token = full["token_ids"][5]
    sampling = {"stop_token_ids": [token]}
    [by_id] = (
        await generate(client, contract_body(prompt, output_mode="text", sampling=sampling))
    )["choices"]
    assert by_id["token_ids"] == full["token_ids"][:6]
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", token)
    assert by_id["text"] == tokenizer.decode(full["token_ids"][:5])
    # min_tokens past the answer's end: vLLM would have sampled on (not modelled).
    sampling = {"min_tokens": len(full["token_ids"])}
    response = await client.post(GENERATE, json=contract_body(prompt, sampling=sampling))
    assert "min_tokens" in error_of(response, 400, "BadRequestError")["message"]
    sampling = {"min_tokens": len(full["token_ids"]) - 1}
    [long] = (await generate(client, contract_body(prompt, sampling=sampling)))["choices"]
    assert long["token_ids"] == full["token_ids"]


# -- routed experts, weight versions, prompt tokens details ----------------------------


@pytest.mark.parametrize(
    ("experts", "dtype", "start"),
    [(64, np.uint8, 0), (256, np.uint8, 5), (300, np.uint16, 0)],
    ids=["64-uint8", "256-uint8-start-5", "300-uint16"],
)
async def test_routed_experts_are_npy(
    serve: Serve, tokenizer: Any, experts: int, dtype: Any, start: int
) -> None:
    client, _ = await serve(
        **VLLM, return_routed_experts=True, routed_experts_num_experts=experts,
        routed_experts_layers=3, routed_experts_top_k=2,
    )  # fmt: skip
    prompt = prompt_ids(tokenizer)
    for mode in ("tokens", "derender"):
        body = contract_body(
            prompt, output_mode=mode, sampling={"routed_experts_prompt_start": start}
        )
        [choice] = (await generate(client, body))["choices"]
        array = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
        ids = choice["token_ids"]
        rows = len(prompt) + len(ids) - 1 - start
        assert array.shape == (rows, 3, 2) and array.dtype == dtype
        forwarded = (prompt + ids)[:-1]
        expected = routed_experts(forwarded, start, layers=3, top_k=2, num_experts=experts)
        assert (array == expected).all() and int(array.max()) < experts


async def test_routed_experts_are_off_by_default(serve: Serve, tokenizer: Any) -> None:
    client, emulator = await serve(**VLLM)
    assert emulator.config.return_routed_experts is False
    [choice] = (await generate(client, contract_body(prompt_ids(tokenizer))))["choices"]
    assert choice["routed_experts"] is None


async def test_prompt_tokens_details_and_weight_versions(serve: Serve) -> None:
    client, _ = await serve(**VLLM, enable_prompt_tokens_details=True, weight_version="v9")
    prompt = list(range(1000, 1040))
    first = await generate(client, contract_body(prompt))
    again = await generate(client, contract_body(prompt))
    details = [a["usage"]["prompt_tokens_details"] for a in (first, again)]
    assert list(details[0]) == ["cached_tokens", "created_cache_tokens", "multimodal_tokens"]
    assert [d["cached_tokens"] for d in details] == [0, 32]  # two full 16-token blocks
    assert details[1]["created_cache_tokens"] is None and details[1]["multimodal_tokens"] is None
    n = first["usage"]["completion_tokens"]
    assert first["choices"][0]["weight_versions"] == [{"version": "v9", "start": 0, "end": n}]


# -- aborts and faults ------------------------------------------------------------------


async def test_abort_requests_aborts_a_running_request(serve: Serve, tokenizer: Any) -> None:
    client, emulator = await serve(**VLLM)
    prompt = prompt_ids(tokenizer)
    answers: list[dict[str, Any]] = []

    async def call() -> None:
        body = contract_body(prompt, request_id="r-7")
        answers.append(await generate(client, body, **{FAULT_HEADER: "stall"}))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await emulator.wait_until(lambda: "generate-tokens-r-7" in emulator.vllm_running)
            other = await client.post(ABORT, json={"request_ids": ["r-7"]})  # the bare id: no match
            assert (other.status_code, other.content) == (200, b"")
            assert emulator.vllm_running == {"generate-tokens-r-7"}
            done = await client.post(ABORT, json={"request_ids": ["generate-tokens-r-7"]})
            assert (done.status_code, done.content) == (200, b"")
    [answer] = answers
    [choice] = answer["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("abort", None)
    assert choice["token_ids"] == [] and choice["weight_versions"] == []
    assert choice["message"]["content"] == ""
    assert answer["usage"]["completion_tokens"] == 0
    assert emulator.aborted == 1 and emulator.abort_requests == ["r-7", "generate-tokens-r-7"]


@pytest.mark.parametrize(
    ("raw", "status", "type_", "message"),
    [
        (b"{}", 400, "Bad Request", "Missing 'request_ids' in request body"),
        (b"{", 400, "Bad Request", "JSON decode error: Expecting property name enclosed in "
         "double quotes: line 1 column 2 (char 1)"),
        (b'{"request_ids": []}', 200, None, None),
    ],
    ids=["missing-ids", "bad-json", "empty-list"],
)  # fmt: skip
async def test_abort_requests_body(
    serve: Serve, raw: bytes, status: int, type_: str | None, message: str | None
) -> None:
    client, _ = await serve(**VLLM)
    response = await client.post(ABORT, content=raw, headers={"content-type": "application/json"})
    if type_ is None:
        assert (response.status_code, response.content) == (status, b"")
    else:
        assert error_of(response, status, type_)["message"] == message


def _first_entry(raw: bytes) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(raw)["choices"][0]["logprobs"]["content"][0]
    return entry


def _unparsable(raw: bytes, loads: Callable[[bytes], Any]) -> bool:
    try:
        loads(raw)
    except ValueError:
        return True
    return False


def _token_ids(raw: bytes) -> list[Any]:
    ids: list[Any] = orjson.loads(raw)["choices"][0]["token_ids"]
    return ids


def _usage(raw: bytes) -> dict[str, Any]:
    usage: dict[str, Any] = orjson.loads(raw)["usage"]
    return usage


BODY_FAULTS: dict[str, Callable[[bytes], bool]] = {
    "malformed_json": lambda raw: _unparsable(raw, json.loads),
    "nan_logprob": lambda raw: (
        _unparsable(raw, orjson.loads) and math.isnan(_first_entry(raw)["logprob"])
    ),
    "infinity_logprob": lambda raw: (
        _unparsable(raw, orjson.loads) and math.isinf(_first_entry(raw)["logprob"])
    ),
    "positive_logprob": lambda raw: _first_entry(raw)["logprob"] == 0.5,
    "bool_token_id": lambda raw: _token_ids(raw)[0] is True,
    "str_token_id": lambda raw: _token_ids(raw)[0] == "123",
    "float_token_id": lambda raw: type(_token_ids(raw)[0]) is float,
    "out_of_vocab_id": lambda raw: _token_ids(raw)[0] == VOCAB,
    "length_mismatch": lambda raw: _usage(raw)["completion_tokens"] == len(_token_ids(raw)) + 1,
    "prompt_tokens_mismatch": lambda raw: _usage(raw)["prompt_tokens"] == 8,
    "missing_meta_info": lambda raw: orjson.loads(raw)["choices"][0]["logprobs"] is None,
    "abort": lambda raw: (
        orjson.loads(raw)["choices"][0]["finish_reason"] == "abort"
        and _token_ids(raw)[-1] != 128001  # one token short: the end token is not there
        and _usage(raw)["completion_tokens"] == len(_token_ids(raw))
    ),
}
# Every fault has a vLLM-shaped test: these, and the ones below.
assert set(BODY_FAULTS) | {
    "http_500",
    "http_400",
    "drop_connection",
    "stall",
    "endless_body",
} == set(FAULTS)


@pytest.mark.parametrize("fault", sorted(BODY_FAULTS), ids=sorted(BODY_FAULTS))
async def test_body_faults(serve: Serve, fault: str) -> None:
    client, emulator = await serve(**VLLM)
    body = contract_body(list(range(100, 107)), sampling={"seed": 3}, request_id="f")
    response = await client.post(GENERATE, json=body, headers={FAULT_HEADER: fault})
    assert response.status_code == 200
    assert BODY_FAULTS[fault](response.content), response.content[:300]
    assert emulator.faults_injected == {fault: 1}
    assert emulator.requests[-1].fault == fault


async def test_logprob_faults_need_logprobs(serve: Serve) -> None:
    """A fault with nothing to break in the answer leaves it whole."""
    client, _ = await serve(**VLLM)
    body = contract_body(list(range(100, 107)), sampling={"logprobs": None})
    response = await client.post(GENERATE, json=body, headers={FAULT_HEADER: "nan_logprob"})
    assert orjson.loads(response.content)["choices"][0]["logprobs"] is None


async def test_abort_fault_parses_the_partial_answer(serve: Serve, tokenizer: Any) -> None:
    """The answer aborted one token short (its end token): the text is whole,
    so the calls are parsed; the finish reason stays "abort"."""
    client, _ = await serve(**VLLM, tool_call_parser="hermes")
    prompt = prompt_ids(tokenizer, tools=TOOLS)
    body = contract_body(prompt, parse_context={"tools": TOOLS, "tool_choice": "auto"})
    answer = await generate(client, body, **{FAULT_HEADER: "abort"})
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "abort"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["read_file"]


@pytest.mark.parametrize(
    ("fault", "status", "type_"),
    [("http_500", 500, "InternalServerError"), ("http_400", 400, "BadRequestError")],
)
async def test_http_error_faults(serve: Serve, fault: str, status: int, type_: str) -> None:
    client, _ = await serve(**VLLM)
    response = await client.post(GENERATE, json=_body(), headers={FAULT_HEADER: fault})
    assert "injected by the emulator" in error_of(response, status, type_)["message"]


async def test_unknown_fault_name_is_a_vllm_400(serve: Serve) -> None:
    client, _ = await serve(**VLLM)
    response = await client.post(GENERATE, json=_body(), headers={FAULT_HEADER: "nope"})
    assert "unknown fault" in error_of(response, 400, "BadRequestError")["message"]


async def test_drop_connection_is_a_transport_error(serve: Serve) -> None:
    client, emulator = await serve(**VLLM)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await client.post(GENERATE, json=_body(), headers={FAULT_HEADER: "drop_connection"})
    assert (await client.get("/health")).status_code == 200
    assert emulator.faults_injected == {"drop_connection": 1}


async def test_stall_is_cancelled_when_the_client_gives_up(serve: Serve) -> None:
    client, emulator = await serve(**VLLM)
    with trio.fail_after(5), pytest.raises(httpx.ReadTimeout):
        await client.post(
            GENERATE,
            json=_body(),
            headers={FAULT_HEADER: "stall"},
            timeout=httpx.Timeout(10.0, read=0.2),
        )
    with trio.fail_after(5):
        await emulator.wait_for_cancelled(1)
    assert (emulator.inflight, emulator.completed, emulator.vllm_running) == (0, 0, set())


async def test_endless_body_runs_until_the_client_hangs_up(serve: Serve) -> None:
    client, emulator = await serve(**VLLM)
    # A raw socket: read past any answer's size, then hang up.
    url = httpx.URL(str(client.base_url))
    assert url.host and url.port
    payload = orjson.dumps(_body())
    head = (
        f"POST {GENERATE} HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        f"{FAULT_HEADER}: endless_body\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    received = b""
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream(url.host, url.port)
        async with stream:
            await stream.send_all(head.encode() + payload)
            while len(received) < 3 << 20:
                received += await stream.receive_some(1 << 16)
        await emulator.wait_until(lambda: emulator.endless_ended == 1)
    assert received.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in received.split(b"\r\n\r\n", 1)[0].lower()
    assert b'"output_mode":"tokens"' in received


async def test_configured_fault_applies_to_generate(serve: Serve) -> None:
    client, emulator = await serve(**VLLM, fault="http_500", fault_rate=1.0)
    error_of(await client.post(GENERATE, json=_body()), 500, "InternalServerError")
    assert emulator.faults_injected == {"http_500": 1}


# -- configuration and the command line --------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"engine": "trt"},
        {"engine": "sglang", "enable_scale_out": True},
        {"engine": "sglang", "tool_call_parser": "qwen3_json"},  # vLLM's name, not SGLang's
        {"engine": "vllm", "enable_streaming_session": True},
        {"engine": "vllm", "tool_call_parser": "qwen25"},  # SGLang's name, not vLLM's
        {"engine": "vllm", "reasoning_parser": "deepseek-r1"},
        {"engine": "vllm", "routed_experts_num_experts": 70_000},
    ],
    ids=[
        "unknown-engine", "sglang-scale-out", "vllm-parser-name", "vllm-streaming-session",
        "sglang-parser-name", "sglang-reasoning-name", "uint16-overflow",
    ],
)  # fmt: skip
def test_config_rejects_invalid_vllm_settings(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EmulatorConfig(**overrides)


def test_routed_experts_default_per_engine() -> None:
    assert EmulatorConfig().return_routed_experts is True
    assert EmulatorConfig(engine="vllm").return_routed_experts is False
    assert EmulatorConfig(engine="vllm", return_routed_experts=True).return_routed_experts


def _parse(argv: list[str]) -> EmulatorConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_cli_vllm_flags_build_the_config() -> None:
    config = _parse(
        [
            "--engine", "vllm", "--enable-scale-out", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
            "--enable-prompt-tokens-details", "--enable-return-routed-experts",
        ]
    )  # fmt: skip
    assert (config.engine, config.enable_scale_out) == ("vllm", True)
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "qwen3")
    assert config.enable_prompt_tokens_details is True
    assert config.return_routed_experts is True
    plain = _parse(["--engine", "vllm"])
    assert (plain.enable_scale_out, plain.return_routed_experts) == (False, False)
    assert _parse([]).engine == "sglang" and _parse([]).return_routed_experts is True


@pytest.mark.parametrize(
    "argv",
    [
        ["--engine", "vllm", "--enable-auto-tool-choice"],
        ["--engine", "vllm", "--tool-call-parser", "hermes"],
        ["--engine", "sglang", "--enable-scale-out"],
    ],
    ids=["auto-tool-choice-alone", "tool-parser-alone", "sglang-with-vllm-flag"],
)
def test_cli_refuses_inconsistent_vllm_flags(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        _parse(argv)


async def test_stats_route_counts_vllm_requests(serve: Serve) -> None:
    client, emulator = await serve(**VLLM)
    await generate(client, _body())
    stats = (await client.get("/emulator/stats")).json()
    assert stats["received"] == stats["completed"] == 1
    assert (stats["aborted"], stats["abort_requests"]) == (0, [])
    assert isinstance(emulator, Emulator)
