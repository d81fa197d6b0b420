"""Strict validation of a vLLM worker's derender answer (`check_vllm_answer`):
what a sample can be passes, anything else is `UpstreamMalformed` (502,
nothing committed). Answers are written in vLLM 0.33's shape
(docs/research/vllm-0.33-generate-answer.md §1)."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest

from rollout_session.engines.answer import AnswerCheck
from rollout_session.engines.vllm.answer import check_vllm_answer, check_vllm_probe
from rollout_session.errors import UpstreamMalformed

VOCAB = 1000
PROMPT = 12


def _answer(ids: list[int] | None = None, **choice: Any) -> dict[str, Any]:
    ids = [5, 6, 7] if ids is None else ids
    base: dict[str, Any] = {
        "index": 0,
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": ids,
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": [{"version": "default", "start": 0, "end": len(ids)}] if ids else [],
        "message": {
            "role": "assistant",
            "content": "Hello!",
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        },
        "logprobs": {
            "content": [
                {"token": f"t{i}", "logprob": -0.5, "bytes": [116], "top_logprobs": []} for i in ids
            ]
        },
    }
    base.update(choice)
    return {
        "request_id": "generate-tokens-x",
        "model": "served",
        "created": 1,
        "usage": {
            "prompt_tokens": PROMPT,
            "total_tokens": PROMPT + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "output_mode": "derender",
        "choices": [base],
    }


def _check(body: dict[str, Any] | bytes, **check: Any) -> Any:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return check_vllm_answer(raw, AnswerCheck(sent_prompt_tokens=PROMPT, vocab_size=VOCAB, **check))


def test_a_clean_answer_is_read_whole() -> None:
    call = {
        "id": "chatcmpl-tool-0123456789abcdef",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    }
    body = _answer(finish_reason="tool_calls")
    body["choices"][0]["message"].update(content=None, tool_calls=[call], reasoning="hmm")
    body["usage"]["prompt_tokens_details"] = {"cached_tokens": 8}
    got = _check(body)
    assert got.ids.tolist() == [5, 6, 7]
    assert got.logprobs.tolist() == [-0.5] * 3
    assert got.token_texts == ["t5", "t6", "t7"]
    assert (got.content, got.reasoning, got.finish_reason) == (None, "hmm", "tool_calls")
    assert got.tool_calls == [{"index": 0, **call}]
    assert (got.cached_tokens, got.model, got.prompt_tokens) == (8, "served", PROMPT)
    assert got.weight_versions == [{"start": 0, "end": 3, "version": "default"}]


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        target: Any = body
        keys = path.split(".")
        for key in keys[:-1]:
            target = target[int(key)] if key.isdigit() else target[key]
        last = keys[-1]
        if last.isdigit():
            target[int(last)] = value
        else:
            target[last] = value

    return edit


FAULTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "positive-logprob": _set("choices.0.logprobs.content.0.logprob", 0.5),
    "missing-logprob-sentinel": _set("choices.0.logprobs.content.0.logprob", -9999.0),
    "bool-token-id": _set("choices.0.token_ids.0", True),
    "str-token-id": _set("choices.0.token_ids.0", "5"),
    "float-token-id": _set("choices.0.token_ids.0", 5.0),
    "out-of-vocab": _set("choices.0.token_ids.0", VOCAB),
    "negative-id": _set("choices.0.token_ids.0", -1),
    "length-mismatch": _set("usage.completion_tokens", 4),
    "no-logprobs": _set("choices.0.logprobs", None),
    "prompt-tokens": _set("usage.prompt_tokens", PROMPT + 1),
    "no-message": lambda b: b["choices"][0].pop("message"),
    "two-choices": lambda b: b["choices"].append(b["choices"][0]),
    "tokens-mode": _set("output_mode", "tokens"),
    "spans-gap": _set("choices.0.weight_versions", [{"version": "a", "start": 1, "end": 3}]),
    "spans-short": _set("choices.0.weight_versions", [{"version": "a", "start": 0, "end": 2}]),
}


@pytest.mark.parametrize("edit", list(FAULTS.values()), ids=list(FAULTS))
def test_an_answer_that_cannot_be_a_sample_is_refused(
    edit: Callable[[dict[str, Any]], None],
) -> None:
    body = _answer()
    edit(body)
    with pytest.raises(UpstreamMalformed):
        _check(body)


@pytest.mark.parametrize(
    "text", [b'{"choices": [', b"NaN", b"[]"], ids=["cut", "nan", "not-an-object"]
)
def test_bodies_that_are_not_json_answers_are_refused(text: bytes) -> None:
    with pytest.raises(UpstreamMalformed):
        _check(text)


def test_nan_and_infinity_logprobs_are_refused() -> None:
    raw = orjson.dumps(_answer()).replace(b'"logprob":-0.5', b'"logprob":NaN', 1)
    with pytest.raises(UpstreamMalformed, match="not valid JSON"):
        _check(raw)


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_routed_experts_are_decoded_from_npy(dtype: str) -> None:
    # numpy2base64; rows from routed_experts_prompt_start to prompt + output - 1.
    start = 4
    rows = PROMPT + 3 - 1 - start
    array = (np.arange(rows * 2 * 3) % 200).reshape(rows, 2, 3).astype(dtype)
    got = _check(_answer(routed_experts=_npy(array)), experts_from=start)
    data, width = got.experts
    assert width == 6
    assert np.frombuffer(data, "<i4").tolist() == array.reshape(-1).tolist()


@pytest.mark.parametrize(
    "blob",
    [
        None,
        "not base64!",
        _npy(np.zeros((3, 2, 3), np.uint8)),
        _npy(np.zeros((10, 6), np.uint8)),
        # A dtype vLLM does not send, whose ids the int32 store could wrap.
        _npy(np.full((10, 2, 3), 2**40, np.int64)),
    ],
    ids=["missing", "not-base64", "wrong-rows", "wrong-rank", "int64"],
)
def test_bad_routed_experts_are_refused(blob: str | None) -> None:
    with pytest.raises(UpstreamMalformed, match="routed_experts"):
        _check(_answer(routed_experts=blob), experts_from=4)


def test_the_probe_reads_a_tokens_answer() -> None:
    body: dict[str, Any] = {
        "request_id": "generate-tokens-x",
        "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1},
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": [3],
                "logprobs": {"content": [{"token_id": 3, "logprob": -0.1, "top_logprobs": []}]},
            }
        ],
    }
    check_vllm_probe(orjson.dumps(body))
    body["choices"][0]["logprobs"]["content"][0]["logprob"] = 1.0
    with pytest.raises(UpstreamMalformed):
        check_vllm_probe(orjson.dumps(body))
