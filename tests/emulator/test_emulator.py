"""The SGLang emulator over real sockets: shapes, determinism, tokens, cache, faults."""

from __future__ import annotations

import argparse
import base64
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import trio
import trio.testing
from transformers import AutoTokenizer

from rollout_session.emulator.app import start_emulator
from rollout_session.emulator.cli import add_arguments, config_from_args
from rollout_session.emulator.faults import FAULT_HEADER
from rollout_session.emulator.model.prompt_reader import ALL_TOOLS
from rollout_session.emulator.prefix_cache import PrefixCache
from rollout_session.emulator.sglang.answer import routed_experts_blob

# Aliased: pytest would collect a module-level name starting with "test_".
from rollout_session.emulator.tokenizer import builtin_template
from rollout_session.emulator.tokenizer import bundled_tokenizer_path as bundled_tokenizer_path
from rollout_session.emulator.worker import EmulatorConfig
from tests.emulator.conftest import Serve
from tests.loopback import TLS

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List the files, please."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "limit": {"type": "integer"},
                    "follow": {"type": "boolean"},
                    "mode": {"type": "string", "enum": ["text", "bytes"]},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "list_dir", "parameters": {"type": "object", "properties": {}}},
    },
]
NOPE = {"type": "function", "function": {"name": "nope"}}
# The SGLang parsers of the bundled (ChatML/Qwen) template: SGLang's chat route
# parses tool calls and reasoning only on a worker launched with them.
TOOL_PARSER = {"tool_call_parser": "qwen25"}
FLAT_ERROR_KEYS = {"object", "message", "type", "param", "code"}


def _as_session_server_sends(body: dict[str, Any]) -> dict[str, Any]:
    """The fields a session server always sets: the prompt as ``input_ids``
    (rendered here with the bundled template, or the body's own) and
    ``return_meta_info``."""
    body = {"return_meta_info": True, **body}
    if "input_ids" not in body and "messages" in body:
        template = body.pop("_template", None)
        body["input_ids"] = render(
            _bundled_tokenizer(),
            body["messages"],
            tools=body.get("tools"),
            chat_template=template,
            add_generation_prompt=True,
            **(body.get("chat_template_kwargs") or {}),
        )
    return body


@functools.cache
def _bundled_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(bundled_tokenizer_path())


async def chat(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json=_as_session_server_sends(body))
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def sampled(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    entries = answer["choices"][0]["meta_info"]["output_token_logprobs"]
    return [e[1] for e in entries], [e[0] for e in entries]


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return encode(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))


async def test_info_routes_and_tokenizer_path(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(model_name="m/one", weight_version="v7")
    assert (await client.get("/health")).json() == {}
    assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["m/one"]
    info = (await client.get("/get_model_info")).json()
    assert info["model_path"] == "m/one"
    assert info["is_generation"] is True
    assert info["weight_version"] == "v7"
    loaded = AutoTokenizer.from_pretrained(info["tokenizer_path"])
    assert loaded.eos_token_id == tokenizer.eos_token_id
    assert len(loaded) == len(tokenizer)


@pytest.mark.parametrize("radix", [False, True], ids=["default", "session-radix"])
async def test_server_info_has_sglang_field_names(serve: Serve, radix: bool) -> None:
    client, _ = await serve(model_name="m/one", enable_session_radix_cache=radix)
    info = (await client.get("/server_info")).json()
    assert info["enable_session_radix_cache"] is radix
    assert info["enable_streaming_session"] is False
    assert info["model_path"] == info["served_model_name"] == "m/one"
    assert info["version"] == "0.5.23"


async def test_answer_has_sglang_shape(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(weight_version="w3")
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True)
    answer = await chat(client, {"messages": MESSAGES, "input_ids": prompt, "rid": "r-1"})
    assert set(answer) == {"id", "object", "created", "model", "choices", "usage"}
    assert answer["id"] == "r-1"
    assert answer["object"] == "chat.completion"
    choice = answer["choices"][0]
    assert set(choice) == {"index", "message", "finish_reason", "matched_stop", "meta_info"}
    assert set(choice["meta_info"]) == {
        "id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
        "reasoning_tokens", "weight_version", "num_retractions", "e2e_latency",
        "output_token_logprobs", "output_token_logprobs_length",
    }  # fmt: skip
    meta = choice["meta_info"]
    ids, _ = sampled(answer)
    assert meta["prompt_tokens"] == len(prompt) == answer["usage"]["prompt_tokens"]
    assert meta["completion_tokens"] == len(ids) == answer["usage"]["completion_tokens"]
    assert answer["usage"]["total_tokens"] == len(prompt) + len(ids)
    assert meta["weight_version"] == "w3"
    assert meta["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
    assert choice["finish_reason"] == "stop"
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    assert 8 <= len(ids) <= 24


async def test_same_seed_same_answer(serve: Serve) -> None:
    client, _ = await serve(seed=3)
    first = await chat(client, {"messages": MESSAGES, "seed": 11})
    again = await chat(client, {"messages": MESSAGES, "seed": 11})
    other = await chat(client, {"messages": MESSAGES, "seed": 12})
    assert sampled(first) == sampled(again)
    assert first["choices"][0]["message"] == again["choices"][0]["message"]
    assert sampled(first)[0] != sampled(other)[0]
    # Without a request seed the prompt (and the config seed) decide.
    assert sampled(await chat(client, {"messages": MESSAGES})) == sampled(
        await chat(client, {"messages": MESSAGES})
    )


@pytest.mark.parametrize(
    "overrides",
    [{}, {"completion_tokens": 1}, {"completion_tokens": 2}, {"completion_tokens": 61}],
    ids=["default-length", "only-eos", "one-word", "61-tokens"],
)
async def test_sampled_ids_are_canonical_and_rerender_exactly(
    serve: Serve, tokenizer: Any, overrides: dict[str, Any]
) -> None:
    client, _ = await serve(**overrides)
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True)
    for seed in range(4):
        answer = await chat(client, {"messages": MESSAGES, "seed": seed})
        ids, logprobs = sampled(answer)
        content = answer["choices"][0]["message"]["content"]
        if "completion_tokens" in overrides:
            assert len(ids) == overrides["completion_tokens"]
        assert ids[-1] == tokenizer.eos_token_id
        assert encode(tokenizer, content) == ids[:-1]
        assert encode(tokenizer, tokenizer.decode(ids[:-1])) == ids[:-1]
        assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
        conversation = [*MESSAGES, {"role": "assistant", "content": content}]
        assert render(tokenizer, conversation)[: len(prompt) + len(ids)] == prompt + ids


async def test_long_completion_is_exact_and_canonical(serve: Serve, tokenizer: Any) -> None:
    # Its cost is a benchmark's business (benches/), not a timed assertion.
    client, _ = await serve(completion_tokens=30_000, context_length=40_000)
    answer = await chat(client, {"messages": MESSAGES})
    ids, _ = sampled(answer)
    assert len(ids) == 30_000
    assert encode(tokenizer, answer["choices"][0]["message"]["content"]) == ids[:-1]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_cuts_without_end_token(serve: Serve, tokenizer: Any, field: str) -> None:
    client, _ = await serve(completion_tokens=20)
    answer = await chat(client, {"messages": MESSAGES, field: 5})
    ids, _ = sampled(answer)
    choice = answer["choices"][0]
    assert len(ids) == 5
    assert tokenizer.eos_token_id not in ids
    assert choice["finish_reason"] == "length"
    assert choice["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert encode(tokenizer, choice["message"]["content"]) == ids


@pytest.mark.parametrize(
    ("tool_choice", "called"),
    [
        (None, "read_file"),
        ("auto", "read_file"),
        ({"type": "function", "function": {"name": "list_dir"}}, "list_dir"),
    ],
    ids=["absent", "auto", "named"],
)
async def test_tool_call_then_text_after_tool_result(
    serve: Serve, tokenizer: Any, tool_choice: Any, called: str
) -> None:
    client, _ = await serve(**TOOL_PARSER)
    body: dict[str, Any] = {"messages": MESSAGES, "tools": TOOLS, "seed": 5}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    answer = await chat(client, body)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    # SGLang rewrites the one finish_reason dict the choice and meta_info share.
    assert choice["meta_info"]["finish_reason"] == {"type": "tool_calls", "matched": None}
    assert choice["matched_stop"] is None
    message = choice["message"]
    assert message["role"] == "assistant"
    assert message["content"] == ""
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_")
    assert (call["index"], call["type"], call["function"]["name"]) == (0, "function", called)
    arguments = json.loads(call["function"]["arguments"])
    if called == "read_file":
        assert set(arguments) == {"path", "limit", "follow", "mode"}
        assert isinstance(arguments["path"], str)
        assert type(arguments["limit"]) is int
        assert type(arguments["follow"]) is bool
        assert arguments["mode"] in ("text", "bytes")
    else:
        assert arguments == {}
    ids, _ = sampled(answer)
    expected = (
        f'<tool_call>\n{{"name": "{called}", "arguments": '
        f"{call['function']['arguments']}}}\n</tool_call>"
    )
    assert tokenizer.decode(ids[:-1]) == expected
    prompt = render(tokenizer, MESSAGES, tools=TOOLS, add_generation_prompt=True)
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    full = render(tokenizer, [*MESSAGES, assistant], tools=TOOLS)
    assert full[: len(prompt) + len(ids)] == prompt + ids

    tool_result = {"role": "tool", "tool_call_id": call["id"], "content": "a.py b.py"}
    follow_up = await chat(client, {**body, "messages": [*MESSAGES, assistant, tool_result]})
    choice = follow_up["choices"][0]
    if tool_choice is None or tool_choice == "auto":
        assert choice["finish_reason"] == "stop"
        assert "tool_calls" not in choice["message"]
        assert choice["message"]["content"]


async def test_tool_choice_none_answers_with_text(serve: Serve) -> None:
    client, _ = await serve()
    answer = await chat(client, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in answer["choices"][0]["message"]


async def test_reasoning_is_split_and_rerenders_with_qwen3(serve: Serve, tokenizer: Any) -> None:
    template = builtin_template("qwen3")
    client, _ = await serve(reasoning=True, chat_template=template, reasoning_parser="qwen3")
    answer = await chat(client, {"messages": MESSAGES, "seed": 2, "_template": template})
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"]
    assert message["content"]
    assert "<think>" not in message["content"] and "</think>" not in message["content"]
    ids, _ = sampled(answer)
    assert tokenizer.decode(ids[:-1]) == (
        f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
    )
    assert 0 < answer["choices"][0]["meta_info"]["reasoning_tokens"] < len(ids)
    prompt = render(tokenizer, MESSAGES, chat_template=template, add_generation_prompt=True)
    full = render(tokenizer, [*MESSAGES, {"role": "assistant", **message}], chat_template=template)
    assert full[: len(prompt) + len(ids)] == prompt + ids

    plain = await chat(
        client,
        {
            "messages": MESSAGES,
            "chat_template_kwargs": {"enable_thinking": False},
            "_template": template,
        },
    )
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert "<think>" not in plain["choices"][0]["message"]["content"]
    assert plain["choices"][0]["meta_info"]["prompt_tokens"] == len(
        render(
            tokenizer, MESSAGES, chat_template=template, add_generation_prompt=True,
            enable_thinking=False,
        )
    )  # fmt: skip


@pytest.mark.parametrize("radix", [False, True], ids=["plain", "session-radix"])
async def test_prefix_cache_grows_and_close_keeps_it(serve: Serve, radix: bool) -> None:
    client, emulator = await serve(enable_session_radix_cache=radix)
    session = {"session_id": "s1"}
    prompt1 = list(range(1000, 1100))
    first = await chat(client, {"input_ids": prompt1, **session})
    assert first["choices"][0]["meta_info"]["cached_tokens"] == 0
    ids1, _ = sampled(first)
    prompt2 = prompt1 + ids1 + list(range(2000, 2030))
    second = await chat(client, {"input_ids": prompt2, **session})
    cached = second["choices"][0]["meta_info"]["cached_tokens"]
    assert cached == (len(prompt1) + len(ids1)) // 16 * 16
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    # With the flag the session references its latest request's path; without it nothing.
    ids2, _ = sampled(second)
    referenced = (len(prompt2) + len(ids2)) // 16 * 16
    assert emulator.cache.session_tokens("s1") == (referenced if radix else 0)
    assert set(emulator.cache.refs(prompt2 + ids2)) == ({1} if radix else {0})

    response = await client.post("/close_session", json={"session_id": "s1"})
    assert response.status_code == 200
    assert emulator.cache.session_tokens("s1") == 0
    assert emulator.sessions_closed == ["s1"]
    # Close frees nothing: the blocks stay cached, unreferenced.
    assert set(emulator.cache.refs(prompt2 + ids2)) == {0}
    again = await chat(client, {"input_ids": prompt2, "session_id": "s1"})
    assert again["choices"][0]["meta_info"]["cached_tokens"] == (len(prompt2) - 1) // 16 * 16


def test_prefix_cache_evicts_lru_leaves_first() -> None:
    cache = PrefixCache(capacity_tokens=64, block_tokens=16)
    a, b = list(range(48)), list(range(100, 148))
    cache.insert(a, ("s", 1))  # no session references without the flag
    assert cache.refs(a) == [0, 0, 0]
    assert cache.match(a) == 32  # the last prompt token is never cached
    assert cache.match([*a, 7]) == 48
    assert cache.match([*a[:20], 9, 9]) == 16
    cache.insert(b)  # 3 more blocks: the least recently used ones of `a` go, deepest first
    assert cache.used_tokens == 64
    assert cache.match([*a, 7]) == 16
    assert cache.match([*b, 7]) == 48


async def test_routed_experts_deltas_concatenate_to_the_full_blob(serve: Serve) -> None:
    layers, top_k = 3, 5
    client, _ = await serve(routed_experts_layers=layers, routed_experts_top_k=top_k)

    def experts(answer: dict[str, Any]) -> np.ndarray:
        raw = base64.b64decode(answer["choices"][0]["meta_info"]["routed_experts"])
        return np.frombuffer(raw, dtype="<i4").reshape(-1, layers, top_k)

    prompt1 = list(range(500, 540))
    first = await chat(client, {"input_ids": prompt1, "return_routed_experts": True})
    ids1, _ = sampled(first)
    forwarded1 = len(prompt1) + len(ids1) - 1
    assert experts(first).shape == (forwarded1, layers, top_k)
    prompt2 = prompt1 + ids1 + list(range(600, 610))
    body2 = {"input_ids": prompt2, "return_routed_experts": True, "seed": 1}
    delta = await chat(client, {**body2, "routed_experts_start_len": forwarded1})
    full = await chat(client, body2)
    ids2, _ = sampled(full)
    assert sampled(delta) == sampled(full)
    assert experts(delta).shape[0] == len(prompt2) + len(ids2) - 1 - forwarded1
    joined = np.concatenate([experts(first), experts(delta)])
    np.testing.assert_array_equal(joined, experts(full))
    assert ((joined >= 0) & (joined < 64)).all()
    local = routed_experts_blob(
        (prompt2 + ids2)[:-1], 0, layers=layers, top_k=top_k, num_experts=64
    )
    assert local == full["choices"][0]["meta_info"]["routed_experts"]


async def test_prompt_over_context_length_is_sglang_400(serve: Serve) -> None:
    client, _ = await serve(context_length=64)
    response = await client.post(
        "/v1/chat/completions", json={"input_ids": list(range(60)), "max_tokens": 10}
    )
    assert response.status_code == 400
    error = response.json()
    assert set(error) == FLAT_ERROR_KEYS
    assert (error["object"], error["type"], error["code"]) == ("error", "BadRequestError", 400)
    assert error["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 64 tokens."
    )
    too_long = await client.post("/v1/chat/completions", json={"input_ids": list(range(64))})
    assert too_long.status_code == 400
    # Without max_tokens the rest of the context is the budget.
    fits = await chat(client, {"input_ids": list(range(60))})
    assert len(sampled(fits)[0]) <= 4


# SGLang's _validate_request: jsonschema's check_schema refuses a string.
BAD_SCHEMA = [{"type": "function", "function": {"name": "f", "parameters": "x"}}]


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (orjson.dumps({"messages": MESSAGES, "stream": True}), {}),
        (b"{}", {}),
        (b"[1, 2]", {}),
        (b"{not json", {}),
        (orjson.dumps({"input_ids": [1, True]}), {}),
        (orjson.dumps({"input_ids": [1, 10**9]}), {}),
        (orjson.dumps({"messages": MESSAGES, "max_tokens": 0}), {}),
        (orjson.dumps({"messages": [{"content": "no role"}]}), {}),
        (orjson.dumps({"messages": MESSAGES, "n": 2}), {}),
        (orjson.dumps({"messages": MESSAGES, "tools": TOOLS, "tool_choice": NOPE}), {}),
        (orjson.dumps({"messages": MESSAGES, "tools": BAD_SCHEMA}), {}),
        (orjson.dumps({"messages": MESSAGES}), {FAULT_HEADER: "no_such_fault"}),
    ],
    ids=[
        "stream", "no-prompt", "not-an-object", "not-json", "bool-input-id", "input-id-oov",
        "max-tokens-0", "message-without-role", "n-2", "unknown-named-tool",
        "parameters-not-a-schema", "unknown-fault",
    ],
)  # fmt: skip
async def test_bad_requests_get_flat_400(
    serve: Serve, body: bytes, headers: dict[str, str]
) -> None:
    client, emulator = await serve()
    response = await client.post(
        "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json", **headers},
    )
    assert response.status_code == 400, response.text
    error = response.json()
    assert set(error) == FLAT_ERROR_KEYS
    assert (error["object"], error["code"]) == ("error", 400)
    assert emulator.received == emulator.completed == 1


def _entries(doc: Any) -> list[Any]:
    return list(doc["choices"][0]["meta_info"]["output_token_logprobs"])


VOCAB = 129278  # the bundled tokenizer's max id + 1
BODY_FAULTS: dict[str, Callable[[bytes], bool]] = {
    "malformed_json": lambda raw: _unparsable(raw, json.loads),
    "nan_logprob": lambda raw: (
        _unparsable(raw, orjson.loads) and math.isnan(_entries(json.loads(raw))[0][0])
    ),
    "infinity_logprob": lambda raw: (
        _unparsable(raw, orjson.loads) and math.isinf(_entries(json.loads(raw))[0][0])
    ),
    "positive_logprob": lambda raw: _entries(orjson.loads(raw))[0][0] > 0,
    "bool_token_id": lambda raw: _entries(orjson.loads(raw))[0][1] is True,
    "str_token_id": lambda raw: isinstance(_entries(orjson.loads(raw))[0][1], str),
    "float_token_id": lambda raw: type(_entries(orjson.loads(raw))[0][1]) is float,
    "out_of_vocab_id": lambda raw: _entries(orjson.loads(raw))[0][1] == VOCAB,
    "length_mismatch": lambda raw: (
        orjson.loads(raw)["choices"][0]["meta_info"]["completion_tokens"]
        != len(_entries(orjson.loads(raw)))
    ),
    "missing_meta_info": lambda raw: "meta_info" not in orjson.loads(raw)["choices"][0],
    "prompt_tokens_mismatch": lambda raw: (
        orjson.loads(raw)["choices"][0]["meta_info"]["prompt_tokens"] != 7
    ),
}


def _unparsable(raw: bytes, loads: Callable[[bytes], Any]) -> bool:
    try:
        loads(raw)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("fault", sorted(BODY_FAULTS), ids=sorted(BODY_FAULTS))
async def test_body_faults(serve: Serve, fault: str) -> None:
    client, emulator = await serve()
    assert emulator.model.vocab_size == VOCAB
    response = await client.post(
        "/v1/chat/completions",
        json={"return_meta_info": True, "input_ids": list(range(100, 107))},
        headers={FAULT_HEADER: fault},
    )
    assert response.status_code == 200
    assert BODY_FAULTS[fault](response.content)
    assert emulator.faults_injected == {fault: 1}
    assert emulator.requests[-1].fault == fault


@pytest.mark.parametrize(("fault", "status"), [("http_500", 500), ("http_400", 400)])
async def test_http_error_faults(serve: Serve, fault: str, status: int) -> None:
    client, _ = await serve()
    response = await client.post(
        "/v1/chat/completions",
        json=_as_session_server_sends({"messages": MESSAGES}),
        headers={FAULT_HEADER: fault},
    )
    assert response.status_code == status
    assert set(response.json()) == FLAT_ERROR_KEYS
    assert response.json()["code"] == status


async def test_drop_connection_is_a_transport_error(serve: Serve) -> None:
    client, emulator = await serve()
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await client.post(
            "/v1/chat/completions",
            json=_as_session_server_sends({"messages": MESSAGES}),
            headers={FAULT_HEADER: "drop_connection"},
        )
    # The connection is gone but the server is fine.
    assert (await client.get("/health")).status_code == 200
    assert emulator.faults_injected == {"drop_connection": 1}


async def test_stall_is_cancelled_when_the_client_gives_up(serve: Serve) -> None:
    client, emulator = await serve()
    outcome: list[type[BaseException]] = []

    async def call() -> None:
        try:
            await client.post(
                "/v1/chat/completions",
                json=_as_session_server_sends({"messages": MESSAGES, "rid": "stalled"}),
                headers={FAULT_HEADER: "stall"},
                timeout=httpx.Timeout(10.0, read=0.2),
            )
        except httpx.ReadTimeout as exc:
            outcome.append(type(exc))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await emulator.wait_for_requests(1)
            assert emulator.inflight == 1
            assert emulator.requests[0].body["rid"] == "stalled"
            await emulator.wait_for_cancelled(1)
    assert outcome == [httpx.ReadTimeout]
    assert (emulator.inflight, emulator.completed, emulator.cancelled) == (0, 0, 1)


async def test_global_fault_rate_is_seeded(serve: Serve) -> None:
    async def statuses() -> list[int]:
        client, _ = await serve(fault="http_500", fault_rate=0.5, seed=7)
        body = {"input_ids": [1, 2, 3], "max_tokens": 2}
        return [
            (await client.post("/v1/chat/completions", json=body)).status_code for _ in range(16)
        ]

    first = await statuses()
    assert set(first) == {200, 500}
    assert await statuses() == first


async def test_sessions_and_stats_route(serve: Serve) -> None:
    client, emulator = await serve()
    opened = await client.post("/open_session", json={"capacity_of_str_len": 1000})
    session_id = opened.json()
    assert isinstance(session_id, str) and session_id in emulator.open_sessions
    await chat(client, {"input_ids": list(range(40)), "session_params": {"id": session_id}})
    assert emulator.requests[-1].session_id == session_id
    assert (await client.post("/close_session", json={})).status_code == 400
    assert (await client.post("/close_session", json={"session_id": session_id})).status_code == 200
    stats = (await client.get("/emulator/stats")).json()
    assert stats["received"] == stats["completed"] == 1
    assert stats["inflight"] == stats["cancelled"] == 0
    assert stats["sessions_opened"] == stats["sessions_closed"] == [session_id]
    assert stats["open_sessions"] == []


async def test_latency_is_charged(serve: Serve) -> None:
    client, _ = await serve(base_latency_s=0.05)
    answer = await chat(client, {"input_ids": [1, 2, 3]})
    assert answer["choices"][0]["meta_info"]["e2e_latency"] >= 0.05


async def test_gpu_contention_queues_prefill_over_http(
    autojump_clock: trio.testing.MockClock, serve: Serve
) -> None:
    # Virtual time (jumps only after 10 ms of real idleness, so loopback I/O
    # in flight never lets it skip ahead): latencies are exact, not measured.
    autojump_clock.autojump_threshold = 0.01
    client, emulator = await serve(gpu_contention=True, prefill_s_per_token=0.001)
    shared = list(range(1000, 1960))
    answers: dict[str, dict[str, Any]] = {}

    async def send(name: str, tail: int) -> None:
        body = {"input_ids": [*shared, *range(tail, tail + 40)], "max_tokens": 1}
        answers[name] = await chat(client, body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, "first", 5000)
        await emulator.wait_until(lambda: emulator.gpu.prefilling)
        nursery.start_soon(send, "queued", 6000)
    first, queued = (answers[k]["choices"][0]["meta_info"] for k in ("first", "queued"))
    assert (first["cached_tokens"], queued["cached_tokens"]) == (0, 960)
    assert first["e2e_latency"] == pytest.approx(1.0, abs=0.005)
    # Waited for the first prefill (1 s), then prefilled its own 40 tokens.
    assert queued["e2e_latency"] == pytest.approx(1.04, abs=0.005)
    stats = (await client.get("/emulator/stats")).json()["gpu"]
    assert stats["prefill_busy_s"] == pytest.approx(1.04, abs=0.005)


@pytest.mark.parametrize(
    "overrides",
    [
        {"model_name": ""},
        {"base_latency_s": -1.0},
        {"decode_s_per_token": math.inf},
        {"context_length": 0},
        {"cache_block_tokens": 0},
        {"cache_capacity_tokens": -1},
        {"completion_tokens": 0},
        {"routed_experts_top_k": 0},
        {"fault": "nope"},
        {"fault_rate": 1.5},
    ],
    ids=lambda o: next(iter(o)),
)
def test_config_rejects_invalid_values(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EmulatorConfig(**overrides)


def test_cli_flags_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--port", "0", "--seed", "4", "--fault", "stall", "--fault-rate", "0.25",
            "--chat-template", "qwen3", "--reasoning", "--completion-tokens", "100",
            "--prefill-s-per-token", "0.001", "--routed-experts-layers", "48",
            "--gpu-contention",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert (args.host, args.port) == ("127.0.0.1", 0)
    assert config.chat_template == builtin_template("qwen3")
    assert (config.seed, config.fault, config.fault_rate) == (4, "stall", 0.25)
    assert (config.reasoning, config.completion_tokens) == (True, 100)
    assert (config.prefill_s_per_token, config.routed_experts_layers) == (0.001, 48)
    assert config.gpu_contention is True
    assert config.tokenizer_path == bundled_tokenizer_path()
    assert parser.parse_args([]).port == 30000
    assert config_from_args(parser.parse_args([])).gpu_contention is False


async def test_start_with_a_loaded_hf_tokenizer(nursery: trio.Nursery, tokenizer: Any) -> None:
    server, emulator = await start_emulator(nursery, tokenizer=tokenizer)
    async with httpx.AsyncClient(base_url=server.url, verify=TLS) as client:
        answer = await chat(client, {"input_ids": [5, 6, 7]})
    assert emulator.completed == 1
    assert sampled(answer)[0][-1] == tokenizer.eos_token_id
    await server.aclose()


async def test_like_sglang_it_needs_input_ids_and_gives_meta_info_only_when_asked(
    serve: Serve,
) -> None:
    """No silent re-render of `messages` (a session server must send its ids),
    and no `meta_info` unless `return_meta_info` (SGLang omits it)."""
    client, _ = await serve()
    refused = await client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "return_meta_info": True}
    )
    assert refused.status_code == 400
    assert "input_ids is required" in refused.json()["message"]
    bare = await client.post("/v1/chat/completions", json={"input_ids": [1, 2, 3]})
    assert bare.status_code == 200
    choice = bare.json()["choices"][0]
    assert "meta_info" not in choice and choice["finish_reason"] == "stop"
    asked = await chat(client, {"input_ids": [1, 2, 3]})
    assert asked["choices"][0]["meta_info"]["completion_tokens"] == len(sampled(asked)[0])


async def test_parallel_tool_calls_when_the_user_asks_for_them(serve: Serve) -> None:
    # The model reads its prompt: the request's parallel_tool_calls is not in it.
    client, _ = await serve(**TOOL_PARSER)
    asks = [MESSAGES[0], {"role": "user", "content": f"List the files; {ALL_TOOLS}."}]
    single = await chat(client, {"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": True})
    assert len(single["choices"][0]["message"]["tool_calls"]) == 1
    answer = await chat(client, {"messages": asks, "tools": TOOLS})
    calls = answer["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["read_file", "list_dir"]
    assert [c["index"] for c in calls] == [0, 1] and calls[0]["id"] != calls[1]["id"]
