"""Strict validation of worker answers (docs/api.md#answer) on SGLang's own shapes."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import pickle
from typing import Any

import numpy as np
import orjson
import pytest

from rollout_session.engines.answer import AnswerCheck
from rollout_session.engines.sglang_chat.answer import (
    check_answer,
    decode_cost,
    parse_worker_answer,
)
from rollout_session.errors import UpstreamMalformed
from tests import FIXTURES

ANSWERS = json.loads((FIXTURES / "sglang_chat_answers.json").read_text())
VOCAB = 151_936  # Qwen's, the fixtures' model


def parse(answer: Any, prompt_tokens: int = 42) -> Any:
    body = answer if isinstance(answer, bytes) else orjson.dumps(answer)
    return parse_worker_answer(body, sent_prompt_tokens=prompt_tokens, vocab_size=VOCAB)


def test_text_answer_fixture() -> None:
    answer = parse(ANSWERS["text_answer"])
    assert answer.ids.tolist() == [40, 1184, 1401, 13, 151645]
    assert answer.logprobs.dtype.name == "float32" and (answer.logprobs <= 0).all()
    assert answer.content == "I'll look." and answer.finish_reason == "stop"
    assert (answer.cached_tokens, answer.weight_version) == (32, "default")


def test_tool_call_fixture() -> None:
    answer = parse(ANSWERS["tool_call_answer"])
    assert answer.finish_reason == "tool_calls"
    assert answer.tool_calls[0]["function"] == {
        "name": "read_file",
        "arguments": '{"path": "main.py"}',
    }


def test_top_level_meta_info_and_two_element_entries_are_accepted() -> None:
    answer = json.loads(json.dumps(ANSWERS["text_answer"]))
    meta = answer["choices"][0].pop("meta_info")
    meta["output_token_logprobs"] = [e[:2] for e in meta["output_token_logprobs"]]
    answer["meta_info"] = meta
    assert parse(answer).ids.tolist() == [40, 1184, 1401, 13, 151645]


def mutate(path: str, value: Any) -> bytes:
    """The text answer with one JSON-path element replaced by raw JSON text."""
    answer = json.loads(json.dumps(ANSWERS["text_answer"]))
    target = answer
    keys = path.split("/")
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    last = keys[-1]
    marker = "__MARK__"
    if isinstance(target, list):
        target[int(last)] = marker
    else:
        target[last] = marker
    return json.dumps(answer).replace(f'"{marker}"', value).encode()


ENTRY0 = "choices/0/meta_info/output_token_logprobs/0"
META = "choices/0/meta_info"
BAD = [
    ("nan", mutate(f"{ENTRY0}/0", "NaN"), "json"),
    ("infinity", mutate(f"{ENTRY0}/0", "Infinity"), "json"),
    ("huge-float", mutate(f"{ENTRY0}/0", "-1e400"), "logprob"),
    ("positive", mutate(f"{ENTRY0}/0", "0.5"), "logprob"),
    ("bool-logprob", mutate(f"{ENTRY0}/0", "false"), "logprob"),
    ("bool-id", mutate(f"{ENTRY0}/1", "true"), "token_id"),
    ("str-id", mutate(f"{ENTRY0}/1", '"40"'), "token_id"),
    ("float-id", mutate(f"{ENTRY0}/1", "40.0"), "token_id"),
    ("negative-id", mutate(f"{ENTRY0}/1", "-1"), "token_id"),
    ("oov-id", mutate(f"{ENTRY0}/1", str(VOCAB)), "token_id"),
    ("short-entry", mutate(ENTRY0, "[-0.1]"), "output_token_logprobs"),
    ("entry-not-list", mutate(ENTRY0, "{}"), "output_token_logprobs"),
    ("length", mutate(f"{META}/completion_tokens", "6"), "length_mismatch"),
    ("bool-length", mutate(f"{META}/completion_tokens", "true"), "completion_tokens"),
    ("prompt-tokens", mutate(f"{META}/prompt_tokens", "41"), "prompt_tokens_mismatch"),
    ("no-meta", mutate(META, "null"), "meta_info_missing"),
    ("no-logprobs", mutate(f"{META}/output_token_logprobs", "null"), "output_token_logprobs"),
    ("message-not-object", mutate("choices/0/message", "[]"), "message"),
    ("no-choices", mutate("choices", "[]"), "choices"),
    ("truncated", orjson.dumps(ANSWERS["text_answer"])[:200], "json"),
    ("not-json", b"<html>", "json"),
]


@pytest.mark.parametrize(("body", "kind"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_answers_are_rejected(body: bytes, kind: str) -> None:
    with pytest.raises(UpstreamMalformed) as info:
        parse(body)
    assert info.value.kind == kind
    assert info.value.status_code == 502


def test_check_answer_decodes_routed_experts_and_pickles() -> None:
    # What a validation worker process returns must survive pickling intact.
    width = 3
    answer = copy.deepcopy(ANSWERS["text_answer"])
    sampled = len(answer["choices"][0]["meta_info"]["output_token_logprobs"])
    # Positions 10.. of a 42-token prompt plus the sampled ones but the last.
    values = np.arange((42 + sampled - 1 - 10) * width, dtype="<i4")
    answer["choices"][0]["meta_info"]["routed_experts"] = base64.b64encode(
        values.tobytes()
    ).decode()
    check = AnswerCheck(sent_prompt_tokens=42, vocab_size=VOCAB, experts_from=10)
    parsed, experts = pickle.loads(pickle.dumps(check_answer(orjson.dumps(answer), check)))
    assert experts == (values.tobytes(), width)
    assert parsed.routed_experts is None  # the blob is not carried twice
    assert parsed.ids.tolist() == [40, 1184, 1401, 13, 151645]
    with pytest.raises(UpstreamMalformed) as caught:
        check_answer(orjson.dumps(answer), dataclasses.replace(check, experts_from=11))
    assert caught.value.kind == "routed_experts"


def test_check_answer_without_routed_experts_is_parse_worker_answer() -> None:
    body = orjson.dumps(ANSWERS["tool_call_answer"])
    parsed, experts = check_answer(body, AnswerCheck(sent_prompt_tokens=42, vocab_size=VOCAB))
    expected = parse(body)
    assert experts is None
    assert parsed.ids.tolist() == expected.ids.tolist()
    assert parsed.logprobs.tolist() == expected.logprobs.tolist()
    assert (parsed.tool_calls, parsed.finish_reason) == (expected.tool_calls, "tool_calls")


def test_decode_cost_leaves_out_the_routed_experts_string() -> None:
    answer = copy.deepcopy(ANSWERS["text_answer"])
    plain = orjson.dumps(answer)
    assert decode_cost(plain, experts=True) == len(plain)
    blob = base64.b64encode(bytes(300_000)).decode()
    answer["choices"][0]["meta_info"]["routed_experts"] = blob
    with_experts = orjson.dumps(answer)
    # The key and the string are left out; the closing quote still counts.
    cost = len(with_experts) - len(blob) - len('"routed_experts":"')
    assert decode_cost(with_experts, experts=True) == cost
    # Not asked for: not looked for (counted in, to the safe side).
    assert decode_cost(with_experts, experts=False) == len(with_experts)
