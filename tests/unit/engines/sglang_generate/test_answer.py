"""The strict check of a worker's ``/generate`` answer (docs/engines.md#the-answer).

The valid body is SGLang 0.5.23's shape for one non-streamed request
(tokenizer_manager.TokenizerManager._handle_batch_output and
convert_logprob_style): ``{"text", "output_ids", "meta_info"}``,
``output_ids`` through the stop token, one ``[logprob, id, text]`` per
output id in ``meta_info.output_token_logprobs``.
"""

from __future__ import annotations

import base64
import copy
import json
import pickle
from typing import Any

import numpy as np
import orjson
import pytest

from rollout_session.engines.answer import LOGPROB_EPSILON, AnswerCheck
from rollout_session.engines.sglang_generate.answer import (
    GenerateAnswer,
    check_generate_answer,
    check_generate_ids,
)
from rollout_session.errors import UpstreamMalformed

VOCAB = 151_936  # Qwen's
PROMPT = 12
IDS = [13048, 13, 151645]  # "Hi", ".", <|im_end|>

ANSWER: dict[str, Any] = {
    "text": "Hi.",  # the stop token trimmed (trim_matched_stop); output_ids keep it
    "output_ids": IDS,
    "meta_info": {
        "id": "0c1e7d0b6f2a4c0e9d3b5a7f1e2d4c6b",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": PROMPT,
        "weight_version": "default",
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": [
            [-0.25, 13048, "Hi"],
            [-0.5, 13, "."],
            [-0.125, 151645, "<|im_end|>"],  # the stop token's entry is included
        ],
        "output_token_logprobs_length": 3,
        "reasoning_tokens": 0,
        "completion_tokens": 3,
        "cached_tokens": 8,
        "weight_versions": [{"version": "default", "start": 0, "end": 3}],
        "e2e_latency": 0.05,
    },
}


def check(body: Any, *, prompt: int = PROMPT, **kwargs: Any) -> GenerateAnswer:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return check_generate_answer(
        raw, AnswerCheck(sent_prompt_tokens=prompt, vocab_size=VOCAB, **kwargs)
    )


def answer(**meta: Any) -> dict[str, Any]:
    """The valid answer with `meta_info` keys replaced."""
    data = copy.deepcopy(ANSWER)
    data["meta_info"].update(meta)
    return data


def test_a_valid_answer_is_accepted() -> None:
    got = check(ANSWER)
    assert got.ids.dtype == np.int32 and got.ids.tolist() == IDS
    assert got.logprobs.dtype == np.float32 and got.logprobs.tolist() == [-0.25, -0.5, -0.125]
    assert got.token_texts == ["Hi", ".", "<|im_end|>"]
    assert got.text == "Hi."
    assert got.finish == {"type": "stop", "matched": 151645}
    assert (got.prompt_tokens, got.cached_tokens, got.reasoning_tokens) == (PROMPT, 8, 0)
    assert got.weight_version == "default"
    assert got.experts is None


def test_meta_info_is_kept_as_the_worker_serialised_it() -> None:
    # The chat route's choice meta_info is ret_item["meta_info"], whole.
    body = json.dumps(ANSWER, indent=1).encode()
    got = check(body)
    start = body.index(b'"meta_info": ') + len(b'"meta_info": ')
    assert got.meta_json == body[start:].rstrip()[:-1].rstrip()
    assert orjson.loads(got.meta_json) == ANSWER["meta_info"]
    # weight_versions.add_weight_versions_to_meta_info's spans, for `metadata`.
    assert got.weight_versions == [{"version": "default", "start": 0, "end": 3}]


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        # schedule_batch FINISH_*.to_json.
        ({"type": "stop", "matched": "END"}, {"type": "stop", "matched": "END"}),
        ({"type": "length", "length": 3}, {"type": "length", "matched": None}),
        (
            {"type": "abort", "message": "aborted", "status_code": None, "err_type": None},
            {"type": "abort", "matched": None},
        ),
    ],
    ids=["stop-string", "length", "abort"],
)
def test_finish_reason_shapes(finish: dict[str, Any], expected: dict[str, Any]) -> None:
    assert check(answer(finish_reason=finish)).finish == expected


@pytest.mark.parametrize(
    "meta",
    [
        # Optional keys SGLang adds (dp_rank, cache breakdown, metrics) are ignored.
        {"dp_rank": 0, "cached_tokens_details": None, "spec_verify_ct": 2},
        # return_text_in_logprobs off: [logprob, id, null].
        {"output_token_logprobs": [[-0.25, 13048, None], [-0.5, 13, None], [-0.125, 151645, None]]},
        {"output_token_logprobs": [[-0.25, 13048], [-0.5, 13], [-0.125, 151645]]},
    ],
    ids=["extra-keys", "null-texts", "two-element-entries"],
)
def test_what_sglang_may_add_is_accepted(meta: dict[str, Any]) -> None:
    got = check(answer(**meta))
    assert got.ids.tolist() == IDS


@pytest.mark.parametrize("key", ["cached_tokens", "reasoning_tokens", "weight_version"])
def test_optional_meta_info_fields_may_be_absent(key: str) -> None:
    data = copy.deepcopy(ANSWER)
    del data["meta_info"][key]
    assert getattr(check(data), key) is None


def test_an_answer_of_no_tokens_is_accepted() -> None:
    data = answer(output_token_logprobs=[], completion_tokens=0, finish_reason={"type": "abort"})
    data["output_ids"], data["text"] = [], ""
    got = check(data)
    assert got.ids.tolist() == [] and got.logprobs.tolist() == []


@pytest.mark.parametrize(
    "logprob", [5e-5, LOGPROB_EPSILON, 0.0], ids=["half-epsilon", "epsilon", "zero"]
)
def test_epsilon_positive_noise_is_clamped_to_zero(logprob: float) -> None:
    entries = copy.deepcopy(ANSWER["meta_info"]["output_token_logprobs"])
    entries[0][0] = logprob
    got = check(answer(output_token_logprobs=entries))
    assert got.logprobs.tolist() == [0.0, -0.5, -0.125]


def mutate(path: str, raw: str | None) -> bytes:
    """The valid answer with one element (a "/"-separated path) replaced by
    raw JSON text, or removed when `raw` is None."""
    data = copy.deepcopy(ANSWER)
    *parents, last = path.split("/")
    target: Any = data
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    index: Any = int(last) if isinstance(target, list) else last
    if raw is None:
        del target[index]
        return json.dumps(data).encode()
    target[index] = "__MARK__"
    return json.dumps(data).replace('"__MARK__"', raw).encode()


META = "meta_info"
ENTRY = "meta_info/output_token_logprobs/0"
DEFECTS = [
    # Lengths: output_ids, output_token_logprobs and completion_tokens agree.
    ("completion-tokens", mutate(f"{META}/completion_tokens", "4"), "length_mismatch"),
    ("fewer-output-ids", mutate("output_ids/2", None), "length_mismatch"),
    ("fewer-entries", mutate(f"{META}/output_token_logprobs/2", None), "length_mismatch"),
    # The entries name the same tokens as output_ids, in order.
    ("ids-disagree", mutate("output_ids/1", "14"), "token_id"),
    ("ids-reordered", mutate("output_ids", "[13, 13048, 151645]"), "token_id"),
    ("prompt-tokens", mutate(f"{META}/prompt_tokens", str(PROMPT - 1)), "prompt_tokens_mismatch"),
    # Logprobs: finite, ≤ 0 (up to epsilon), numbers.
    ("positive-logprob", mutate(f"{ENTRY}/0", "0.5"), "schema"),
    ("nan", mutate(f"{ENTRY}/0", "NaN"), "json"),
    ("infinity", mutate(f"{ENTRY}/0", "-Infinity"), "json"),
    ("overflowing-float", mutate(f"{ENTRY}/0", "-1e400"), "schema"),
    ("bool-logprob", mutate(f"{ENTRY}/0", "false"), "schema"),
    ("null-logprob", mutate(f"{ENTRY}/0", "null"), "schema"),
    ("string-logprob", mutate(f"{ENTRY}/0", '"-0.25"'), "schema"),
    # Ids: ints inside the vocabulary, never bools.
    ("id-at-vocab", mutate(f"{ENTRY}/1", str(VOCAB)), "schema"),
    ("output-id-at-vocab", mutate("output_ids/0", str(VOCAB)), "schema"),
    ("negative-id", mutate(f"{ENTRY}/1", "-1"), "schema"),
    ("bool-id", mutate(f"{ENTRY}/1", "true"), "schema"),
    ("bool-output-id", mutate("output_ids/0", "true"), "schema"),
    ("float-id", mutate(f"{ENTRY}/1", "13048.0"), "schema"),
    ("string-id", mutate(f"{ENTRY}/1", '"13048"'), "schema"),
    ("short-entry", mutate(ENTRY, "[-0.25]"), "schema"),
    ("entry-not-list", mutate(ENTRY, '{"logprob": -0.25}'), "schema"),
    ("text-not-string", mutate(f"{ENTRY}/2", "7"), "schema"),
    # Missing or mistyped fields.
    ("no-text", mutate("text", None), "schema"),
    ("null-text", mutate("text", "null"), "schema"),
    ("no-output-ids", mutate("output_ids", None), "schema"),
    ("no-meta-info", mutate(META, None), "schema"),
    ("null-meta-info", mutate(META, "null"), "schema"),
    ("no-logprobs", mutate(f"{META}/output_token_logprobs", None), "schema"),
    ("null-logprobs", mutate(f"{META}/output_token_logprobs", "null"), "schema"),
    ("no-completion-tokens", mutate(f"{META}/completion_tokens", None), "schema"),
    ("bool-completion-tokens", mutate(f"{META}/completion_tokens", "true"), "schema"),
    ("no-prompt-tokens", mutate(f"{META}/prompt_tokens", None), "prompt_tokens_mismatch"),
    ("no-finish-reason", mutate(f"{META}/finish_reason", None), "schema"),
    ("null-finish-reason", mutate(f"{META}/finish_reason", "null"), "schema"),
    ("string-finish-reason", mutate(f"{META}/finish_reason", '"stop"'), "schema"),
    ("finish-without-type", mutate(f"{META}/finish_reason/type", None), "schema"),
    ("matched-list", mutate(f"{META}/finish_reason/matched", "[1]"), "schema"),
    ("cached-tokens-string", mutate(f"{META}/cached_tokens", '"8"'), "schema"),
    ("weight-version-number", mutate(f"{META}/weight_version", "1"), "schema"),
    # Not an answer at all.
    ("array", b"[]", "schema"),
    ("truncated", orjson.dumps(ANSWER)[:100], "json"),
    ("not-json", b"<html>", "json"),
    ("empty", b"", "json"),
]


@pytest.mark.parametrize(("body", "kind"), [d[1:] for d in DEFECTS], ids=[d[0] for d in DEFECTS])
def test_a_defect_is_refused_as_upstream_malformed(body: bytes, kind: str) -> None:
    with pytest.raises(UpstreamMalformed) as caught:
        check(body)
    assert caught.value.kind == kind
    assert caught.value.status_code == 502


def test_the_prompt_count_is_what_was_sent() -> None:
    check(ANSWER, prompt=PROMPT)
    with pytest.raises(UpstreamMalformed) as caught:
        check(ANSWER, prompt=PROMPT + 1)
    assert caught.value.kind == "prompt_tokens_mismatch"


def test_an_answer_aborted_in_the_waiting_queue_has_no_prompt_count() -> None:
    """tokenizer_manager._handle_abort_req answers a request aborted before
    it was scheduled with a meta_info of id, finish_reason, weight_version,
    e2e_latency, logprobs and completion_tokens only."""
    meta = {
        "id": "x",
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "default",
        "e2e_latency": 0.01,
        "output_token_logprobs": [],
        "completion_tokens": 0,
    }
    got = check({"text": "", "output_ids": [], "meta_info": meta})
    assert got.finish["type"] == "abort" and got.prompt_tokens == PROMPT and not len(got.ids)


def test_the_vocabulary_bound_is_the_tokenizers() -> None:
    body = orjson.dumps(ANSWER)
    check_generate_answer(body, AnswerCheck(sent_prompt_tokens=PROMPT, vocab_size=151_646))
    with pytest.raises(UpstreamMalformed):
        check_generate_answer(body, AnswerCheck(sent_prompt_tokens=PROMPT, vocab_size=151_645))


def experts_blob(values: np.ndarray) -> str:
    return base64.b64encode(values.astype("<i4").tobytes()).decode()


def test_routed_experts_are_decoded_for_the_new_positions() -> None:
    width, start = 3, 10
    # Positions start.. of the prompt and every sampled token but the last.
    positions = PROMPT + len(IDS) - 1 - start
    values = np.arange(positions * width, dtype="<i4")
    got = check(answer(routed_experts=experts_blob(values)), experts_from=start)
    assert got.experts == (values.tobytes(), width)


@pytest.mark.parametrize(
    ("meta", "width"),
    [({}, None), ({"routed_experts": None}, None), ({}, 3), ({"routed_experts": "%%"}, None)],
    ids=["absent", "null", "stopped-sending", "not-base64"],
)
def test_routed_experts_asked_for_and_missing_are_refused(
    meta: dict[str, Any], width: int | None
) -> None:
    with pytest.raises(UpstreamMalformed) as caught:
        check(answer(**meta), experts_from=10, experts_width=width)
    assert caught.value.kind == "routed_experts"


def test_routed_experts_not_asked_for_are_ignored() -> None:
    assert check(answer(routed_experts="AAAA")).experts is None


def test_the_checked_answer_pickles() -> None:
    # It may be checked in a validation worker process and sent back.
    values = np.arange(6, dtype="<i4")  # 2 positions (PROMPT, PROMPT + 1) of width 3
    got = check(answer(routed_experts=experts_blob(values)), experts_from=PROMPT)
    back = pickle.loads(pickle.dumps(got))
    assert back.ids.tolist() == got.ids.tolist()
    assert back.logprobs.tolist() == got.logprobs.tolist()
    assert (back.text, back.finish, back.token_texts) == (got.text, got.finish, got.token_texts)
    assert back.experts == (values.tobytes(), 3)


def test_a_worker_without_a_tokenizer_answers_ids_only() -> None:
    """`check_generate_ids`: a --skip-tokenizer-init worker's answer has no
    text, which the engine decodes itself; one with text is not that worker."""
    body = answer()
    del body["text"]
    for entry in body["meta_info"]["output_token_logprobs"]:
        entry[2] = None
    ids_only = AnswerCheck(sent_prompt_tokens=PROMPT, vocab_size=VOCAB)
    got = check_generate_ids(orjson.dumps(body), ids_only)
    assert got.text == "" and set(got.token_texts) == {None}
    assert got.ids.tolist() == IDS
    with pytest.raises(UpstreamMalformed, match="has text although"):
        check_generate_ids(orjson.dumps(ANSWER), ids_only)
