"""The chat completion `sglang-generate` answers the agent with: the one
SGLang 0.5.23's chat route writes (serving_chat._build_chat_response,
_process_tool_calls, _process_tool_call_id; usage_processor.UsageProcessor;
weight_versions.build_endpoint_weight_version_metadata)."""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import orjson
import pytest

from rollout_session.engines.sglang_generate.answer import GenerateAnswer
from rollout_session.engines.sglang_generate.parsers import Parsers
from rollout_session.engines.sglang_generate.reply import (
    ParsedAnswer,
    chat_completion,
    error_reply,
    parse_json_array,
    tool_call_id,
)
from tests.sglang_source import SGLang, load_sglang, or_skip

META: dict[str, Any] = {
    "id": "r1",
    "finish_reason": {"type": "stop", "matched": 151645},
    "prompt_tokens": 12,
    "weight_version": "v7",
    "completion_tokens": 3,
    "cached_tokens": 8,
    "reasoning_tokens": 0,
}


def generate_answer(
    *,
    texts: tuple[str | None, ...] = ("Hi", ".", "<|im_end|>"),
    cached: int | None = 8,
    reasoning: int | None = 0,
    weight_version: str | None = "v7",
    meta: dict[str, Any] | None = None,
) -> GenerateAnswer:
    meta = META if meta is None else meta
    n = len(texts)
    return GenerateAnswer(
        ids=np.arange(100, 100 + n, dtype=np.int32),
        logprobs=np.asarray([-0.25, -0.5, -0.125, -1.0][:n], dtype=np.float32),
        token_texts=list(texts),
        text="Hi.",
        finish={"type": "stop", "matched": 151645},
        prompt_tokens=12,
        cached_tokens=cached,
        reasoning_tokens=reasoning,
        weight_version=weight_version,
        experts=None,
        weight_versions=meta.get("weight_versions"),
        meta_json=orjson.dumps(meta),
    )


def parsed(
    content: str = "Hi.",
    reasoning: str | None = None,
    calls: list[dict[str, Any]] | None = None,
    finish: dict[str, Any] | None = None,
) -> ParsedAnswer:
    return ParsedAnswer(
        content, reasoning, calls or [], finish or {"type": "stop", "matched": 151645}
    )


def reply(
    answer: GenerateAnswer | None = None, parse: ParsedAnswer | None = None
) -> dict[str, Any]:
    body = chat_completion("r1", "qwen", answer or generate_answer(), parse or parsed())
    data: dict[str, Any] = orjson.loads(body)
    return data


def test_meta_info_is_the_workers_as_sent() -> None:
    # The chat route passes ret_item["meta_info"] through whole (return_meta_info).
    meta = {**META, "e2e_latency": 0.25, "dp_rank": None, "nested": {"b": [1, 2], "a": "é"}}
    assert reply(generate_answer(meta=meta))["choices"][0]["meta_info"] == meta


def test_the_chat_completion_sglang_writes() -> None:
    before = int(time.time())
    data = reply()
    assert before <= data.pop("created") <= int(time.time())
    assert data == {
        "id": "r1",  # the rid, no chatcmpl- prefix (meta_info["id"])
        "object": "chat.completion",
        "model": "qwen",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi.", "reasoning_content": None},
                "logprobs": {
                    "content": [
                        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": []},
                        {"token": ".", "logprob": -0.5, "bytes": [46], "top_logprobs": []},
                        {
                            "token": "<|im_end|>",
                            "logprob": -0.125,
                            "bytes": list(b"<|im_end|>"),
                            "top_logprobs": [],
                        },
                    ]
                },
                "finish_reason": "stop",
                "matched_stop": 151645,
                "meta_info": META,  # as the worker sent it
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "total_tokens": 15,
            "completion_tokens": 3,
            "reasoning_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
        "metadata": {"weight_version": "v7"},
    }


@pytest.mark.parametrize(
    ("content", "reasoning", "message"),
    [
        # "content should not be None but empty string to make sure retokenize consistency."
        ("", None, {"role": "assistant", "content": "", "reasoning_content": None}),
        ("", "hmm", {"role": "assistant", "content": "", "reasoning_content": "hmm"}),
        ("ok", "hmm", {"role": "assistant", "content": "ok", "reasoning_content": "hmm"}),
    ],
    ids=["empty", "reasoning-only", "both"],
)
def test_content_is_never_null_and_reasoning_is_null_when_absent(
    content: str, reasoning: str | None, message: dict[str, Any]
) -> None:
    assert reply(parse=parsed(content, reasoning))["choices"][0]["message"] == message


def test_tool_calls_are_in_the_message_only_when_found() -> None:
    call = {
        "id": "call_0123456789abcdef01234567",
        "index": 0,
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a"}'},
    }
    finish = {"type": "tool_calls", "matched": None}
    choice = reply(parse=parsed("", None, [call], finish))["choices"][0]
    assert choice["message"]["tool_calls"] == [call]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("tool_calls", None)
    assert "tool_calls" not in reply()["choices"][0]["message"]  # ChatMessage._serialize


@pytest.mark.parametrize(
    ("finish", "reason", "matched"),
    [
        ({"type": "stop", "matched": 151645}, "stop", 151645),  # a stop token id
        ({"type": "stop", "matched": "END"}, "stop", "END"),  # a stop string
        ({"type": "length", "matched": None}, "length", None),
        ({"type": "length"}, "length", None),  # no "matched" key: null
        ({"type": "abort", "matched": None}, "abort", None),
    ],
    ids=["token", "string", "length", "length-no-key", "abort"],
)
def test_finish_reason_and_matched_stop(
    finish: dict[str, Any], reason: str, matched: int | str | None
) -> None:
    choice = reply(parse=parsed(finish=finish))["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"]) == (reason, matched)


@pytest.mark.parametrize(
    ("cached", "reasoning", "usage"),
    [
        (
            None,
            None,
            {
                "prompt_tokens": 12,
                "total_tokens": 15,
                "completion_tokens": 3,
                "reasoning_tokens": 0,
            },
        ),
        (
            0,
            5,
            {
                "prompt_tokens": 12,
                "total_tokens": 15,
                "completion_tokens": 3,
                "reasoning_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 0},
                # UsageProcessor.calculate_token_usage: only when there are some.
                "completion_tokens_details": {"reasoning_tokens": 5},
            },
        ),
    ],
    ids=["no-counts", "cached-and-reasoning"],
)
def test_usage(cached: int | None, reasoning: int | None, usage: dict[str, Any]) -> None:
    answer = generate_answer(cached=cached, reasoning=reasoning)
    assert reply(answer)["usage"] == usage


def test_completion_tokens_count_the_sampled_ids() -> None:
    answer = generate_answer(texts=("a", "b", "c", "d"))
    usage = reply(answer)["usage"]
    assert (usage["completion_tokens"], usage["total_tokens"]) == (4, 16)


@pytest.mark.parametrize(
    ("weight_version", "meta", "metadata"),
    [
        ("v7", META, {"weight_version": "v7"}),
        (None, META, {"weight_version": None}),
        (
            "v8",
            {**META, "weight_versions": [{"version": "v7", "start": 0, "end": 1}]},
            {"weight_version": "v8", "weight_versions": [{"version": "v7", "start": 0, "end": 1}]},
        ),
    ],
    ids=["version", "none", "spans"],
)
def test_metadata_carries_the_weight_version(
    weight_version: str | None, meta: dict[str, Any], metadata: dict[str, Any]
) -> None:
    answer = generate_answer(weight_version=weight_version, meta=meta)
    assert reply(answer)["metadata"] == metadata


def test_logprob_entries_take_the_tokens_text() -> None:
    # token_text or "", bytes of that text in UTF-8 (the chat route's fallback
    # when it cannot use the byte-level decoder).
    answer = generate_answer(texts=(None, "é", "\ufffd"))
    content = reply(answer)["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in content] == [
        ("", []),
        ("é", [195, 169]),
        ("\ufffd", [239, 191, 189]),
    ]
    assert [e["logprob"] for e in content] == [-0.25, -0.5, -0.125]


# -- tool-call ids -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "history", "expected"),
    [
        ({"name": "read_file", "tool_index": 0}, 0, "functions.read_file:0"),
        ({"name": "read_file", "tool_index": 1}, 0, "functions.read_file:1"),
        ({"name": "list_dir", "tool_index": 0}, 3, "functions.list_dir:3"),
        ({"name": "list_dir", "tool_index": 2}, 3, "functions.list_dir:5"),
    ],
    ids=["first", "second-call", "after-history", "second-after-history"],
)
def test_kimi_k2_tool_call_ids_count_the_history(
    call: dict[str, Any], history: int, expected: str
) -> None:
    # _process_tool_call_id: functions.{name}:{history_tool_calls_cnt + tool_index}.
    assert tool_call_id(Parsers("kimi_k2"), call, history) == expected


@pytest.mark.parametrize("parsers", [Parsers(), Parsers("qwen25"), Parsers("pythonic")])
def test_other_tool_call_ids_are_call_and_24_hex(parsers: Parsers) -> None:
    ids = {tool_call_id(parsers, {"name": "f", "tool_index": 0}, 5) for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# -- a forced tool_choice's JSON array ------------------------------------------------

STOP = {"type": "stop", "matched": 151645}
CALLS_AS = {"type": "tool_calls", "matched": None}


def call(name: str, arguments: str, index: int) -> dict[str, Any]:
    return {"name": name, "parameters": arguments, "tool_index": index}


@pytest.mark.parametrize(
    ("text", "finish", "content", "calls", "finish_after"),
    [
        (
            '[{"name": "read_file", "parameters": {"path": "ä.py"}}, {"name": "list_dir"}]',
            STOP,
            "",
            # json.dumps(..., ensure_ascii=False); a missing "parameters" is {}.
            [call("read_file", '{"path": "ä.py"}', 0), call("list_dir", "{}", 1)],
            CALLS_AS,
        ),
        (  # a single object is one call
            '{"name": "list_dir", "parameters": {}}',
            STOP,
            "",
            [call("list_dir", "{}", 0)],
            CALLS_AS,
        ),
        (  # only a stop is rewritten
            '[{"name": "list_dir", "parameters": {}}]',
            {"type": "length", "matched": None},
            "",
            [call("list_dir", "{}", 0)],
            {"type": "length", "matched": None},
        ),
        (  # no array parsed: the text is the content, the type restored, matched stays null
            '[{"name": "read_file", "parameters": {"pa',
            STOP,
            '[{"name": "read_file", "parameters": {"pa',
            [],
            {"type": "stop", "matched": None},
        ),
        (
            "I will not call a tool.",
            STOP,
            "I will not call a tool.",
            [],
            {"type": "stop", "matched": None},
        ),
        ("42", STOP, "42", [], {"type": "stop", "matched": None}),
        ('"list_dir"', STOP, '"list_dir"', [], {"type": "stop", "matched": None}),
        (
            '[{"parameters": {}}]',
            STOP,
            '[{"parameters": {}}]',
            [],
            {"type": "stop", "matched": None},
        ),
        ('[{"name": "a"}, 1]', STOP, '[{"name": "a"}, 1]', [], {"type": "stop", "matched": None}),
        (
            '[{"name": "a", "parameters": {}}',
            {"type": "length", "matched": None},
            '[{"name": "a", "parameters": {}}',
            [],
            {"type": "length", "matched": None},
        ),
        # An empty array parses: no calls, "" and tool_calls (SGLang returns the
        # same; the schema's minItems 1 keeps it from being sampled).
        ("[]", STOP, "", [], CALLS_AS),
    ],
    ids=[
        "list",
        "single-object",
        "length-kept",
        "truncated",
        "prose",
        "number",
        "string",
        "item-without-name",
        "item-not-object",
        "truncated-length",
        "empty-array",
    ],
)
def test_parse_json_array(
    text: str,
    finish: dict[str, Any],
    content: str,
    calls: list[dict[str, Any]],
    finish_after: dict[str, Any],
) -> None:
    # serving_chat._process_tool_calls, its JSON-array path (required/named
    # under a parser whose detector does not own the format).
    finish = dict(finish)
    assert parse_json_array(text, finish) == (content, calls)
    assert finish == finish_after


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "BadRequest"), (500, "InternalServerError"), (503, "InternalServerError")],
)
def test_error_reply_is_the_chat_routes_error_shape(status: int, kind: str) -> None:
    # serving_base.create_error_response (ErrorResponse).
    got = error_reply(status, "no")
    assert got.status == status
    assert got.headers == [(b"content-type", b"application/json")]
    assert orjson.loads(got.body) == {
        "object": "error",
        "message": "no",
        "type": kind,
        "param": None,
        "code": status,
    }


# -- against SGLang's own response model ---------------------------------------------------


@pytest.fixture(scope="module")
def sglang() -> SGLang:
    return or_skip(load_sglang)


@pytest.mark.parametrize(
    ("answer", "parse"),
    [
        (generate_answer(), parsed()),
        (
            generate_answer(
                texts=(None, "é", "x", "y"),
                cached=None,
                reasoning=2,
                meta={**META, "weight_versions": [{"version": "v7", "start": 0, "end": 4}]},
            ),
            parsed(
                "",
                "thinking",
                [
                    {
                        "id": "functions.read_file:0",
                        "index": 0,
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "a"}'},
                    }
                ],
                {"type": "tool_calls", "matched": None},
            ),
        ),
        (generate_answer(weight_version=None), parsed(finish={"type": "length"})),
    ],
    ids=["text", "tool-call-and-reasoning", "length"],
)
def test_sglangs_response_model_reads_the_reply_as_written(
    sglang: SGLang, answer: GenerateAnswer, parse: ParsedAnswer
) -> None:
    body = chat_completion("r1", "qwen", answer, parse)
    ours = orjson.loads(body)
    response = sglang.protocol.ChatCompletionResponse.model_validate_json(body)
    theirs = response.model_dump(mode="json")
    assert {k: v for k, v in theirs.items() if k != "usage"} == {
        k: v for k, v in ours.items() if k != "usage"
    }
    # UsageInfo writes the details it has not got as null; this reply leaves them out.
    assert {k: v for k, v in theirs["usage"].items() if v is not None} == ours["usage"]
