"""The scoring request each engine is sent and the strict reading of its
answer, in the shapes SGLang 0.5.23 and vLLM 0.33.0 answer
(`engines/scoring.py` cites where each comes from)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import pytest

from rollout_session.engines.scoring import SGLANG_SCORING, VLLM_SCORING
from rollout_session.errors import RescoreInterrupted, UpstreamMalformed

IDS = np.array([11, 22, 33, 44], np.int32)
VALUES = [-0.5, -1.25, -3.0]


def sglang_answer(ids: list[int], values: Sequence[object], **meta: Any) -> bytes:
    entries = [[None, ids[0], None], *([v, t, None] for v, t in zip(values, ids[1:], strict=True))]
    return orjson.dumps(
        {
            "text": "",
            "output_ids": [],
            "meta_info": {
                "id": "x",
                "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(ids),
                "completion_tokens": 0,
                "weight_version": "v3",
                "input_token_logprobs": entries,
                "output_token_logprobs": [],
                **meta,
            },
        }
    )


def vllm_answer(ids: list[int], values: list[float], **answer: Any) -> bytes:
    entries: list[Any] = [None]
    entries += [
        {str(t): {"logprob": v, "rank": 1, "decoded_token": None}}
        for v, t in zip(values, ids[1:], strict=True)
    ]
    return orjson.dumps(
        {
            "request_id": "generate-tokens-x",
            "model": "m",
            "prompt_logprobs": entries,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length",
                    "token_ids": [7],
                    "weight_versions": [{"version": "v3", "start": 0, "end": 1}],
                }
            ],
            **answer,
        }
    )


def test_sglang_request_is_prefill_only_over_the_ids() -> None:
    body = orjson.loads(SGLANG_SCORING.body(IDS, "m"))
    assert SGLANG_SCORING.path == "/generate"
    assert body["input_ids"] == IDS.tolist()
    assert body["sampling_params"] == {"max_new_tokens": 0}
    assert (body["return_logprob"], body["logprob_start_len"], body["stream"]) == (True, 0, False)


def test_vllm_request_asks_prompt_logprobs_without_streaming() -> None:
    body = orjson.loads(VLLM_SCORING.body(IDS, "m"))
    assert VLLM_SCORING.path == "/inference/v1/generate"
    assert (body["token_ids"], body["model"], body["stream"]) == (IDS.tolist(), "m", False)
    assert body["sampling_params"]["prompt_logprobs"] == 0
    assert body["sampling_params"]["max_tokens"] == 1  # vLLM refuses 0


@pytest.mark.parametrize(
    ("scoring", "answer"),
    [(SGLANG_SCORING, sglang_answer), (VLLM_SCORING, vllm_answer)],
    ids=["sglang", "vllm"],
)
def test_an_answer_gives_one_value_per_position_the_first_none(scoring: Any, answer: Any) -> None:
    scores = scoring.read(answer(IDS.tolist(), VALUES), IDS)
    assert math.isnan(scores.logprobs[0])
    assert scores.logprobs[1:].tolist() == VALUES
    assert scores.weight_version == "v3"


BAD_SGLANG = {
    "other-token": sglang_answer([11, 22, 99, 44], VALUES),
    "short": sglang_answer([11, 22, 33], VALUES[:2]),
    "sampled": sglang_answer(IDS.tolist(), VALUES, completion_tokens=1),
    "positive": sglang_answer(IDS.tolist(), [-0.5, 0.5, -3.0]),
    "first-scored": orjson.dumps(
        {
            "output_ids": [],
            "meta_info": {
                "completion_tokens": 0,
                "input_token_logprobs": [[-1.0, 11, None], [-1.0, 22, None]],
            },
        }
    ),
    "not-json": b"{",
    "string-logprob": sglang_answer(IDS.tolist(), ["-1", -1.0, -1.0]),
}


@pytest.mark.parametrize("body", BAD_SGLANG.values(), ids=BAD_SGLANG.keys())
def test_a_bad_sglang_answer_is_malformed(body: bytes) -> None:
    ids = IDS[:2] if b'"input_token_logprobs":[[-1.0' in body else IDS
    with pytest.raises(UpstreamMalformed):
        SGLANG_SCORING.read(body, ids)


def test_sglangs_null_for_minus_inf_reads_as_no_value() -> None:
    scores = SGLANG_SCORING.read(sglang_answer(IDS.tolist(), [-0.5, None, -3.0]), IDS)
    assert np.isnan(scores.logprobs[[0, 2]]).all() and scores.logprobs[3] == -3.0


BAD_VLLM = {
    "other-token": vllm_answer([11, 22, 99, 44], VALUES),
    "short": vllm_answer([11, 22, 33], VALUES[:2]),
    "streamed": orjson.dumps({"prompt_logprobs": None, "choices": []}),
    "positive": vllm_answer(IDS.tolist(), [-0.5, 2.0, -3.0]),
}


@pytest.mark.parametrize("body", BAD_VLLM.values(), ids=BAD_VLLM.keys())
def test_a_bad_vllm_answer_is_malformed(body: bytes) -> None:
    with pytest.raises(UpstreamMalformed):
        VLLM_SCORING.read(body, IDS)


def test_vllms_clamp_of_minus_inf_is_kept() -> None:
    scores = VLLM_SCORING.read(vllm_answer(IDS.tolist(), [-0.5, -9999.0, -3.0]), IDS)
    assert scores.logprobs[2] == -9999.0


ABORT = {"type": "abort", "message": "Abort in waiting queue", "status_code": 503}
ABORTED_CHOICE = {"index": 0, "finish_reason": "abort", "token_ids": []}


@pytest.mark.parametrize(
    ("scoring", "body"),
    [
        (
            SGLANG_SCORING,
            sglang_answer(IDS.tolist(), VALUES, finish_reason=ABORT, input_token_logprobs=[]),
        ),
        (
            SGLANG_SCORING,
            sglang_answer(
                IDS.tolist(),
                VALUES,
                finish_reason=ABORT,
                input_token_logprobs=[[None, 11, None], [-0.5, 22, None]],
            ),
        ),
        (
            VLLM_SCORING,
            vllm_answer(IDS.tolist(), VALUES, prompt_logprobs=None, choices=[ABORTED_CHOICE]),
        ),
    ],
    ids=["sglang-before-prefill", "sglang-partway", "vllm-before-prefill"],
)
def test_an_answer_aborted_before_scoring_every_position_is_interrupted(
    scoring: Any, body: bytes
) -> None:
    """Not malformed: the engine aborted it (a weight update); it is sent again."""
    with pytest.raises(RescoreInterrupted, match="aborted the scoring request"):
        scoring.read(body, IDS)


def test_an_aborted_answer_that_scores_every_position_is_used() -> None:
    """vLLM aborted after the prefill, while it sampled the ignored token."""
    body = vllm_answer(IDS.tolist(), VALUES, choices=[ABORTED_CHOICE])
    scores = VLLM_SCORING.read(body, IDS)
    assert scores.logprobs[1:].tolist() == VALUES


@pytest.mark.parametrize(
    ("scoring", "body"),
    [
        (SGLANG_SCORING, sglang_answer(IDS.tolist(), VALUES, input_token_logprobs=[])),
        (VLLM_SCORING, vllm_answer(IDS.tolist(), VALUES, prompt_logprobs=None)),
    ],
    ids=["sglang", "vllm"],
)
def test_without_an_abort_missing_scores_are_malformed(scoring: Any, body: bytes) -> None:
    with pytest.raises(UpstreamMalformed):
        scoring.read(body, IDS)
