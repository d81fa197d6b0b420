"""Scoring a token sequence: one prefill-only request that asks a worker for
the logprob of every position of exactly these ids (a rescore,
docs/training.md#rescoring), and the strict reading of its answer.

Per engine family, as each release answers (facts from the released wheels):

- **SGLang 0.5.23**, ``POST /generate`` with ``input_ids``,
  ``sampling_params.max_new_tokens: 0``, ``return_logprob`` and
  ``logprob_start_len: 0``: a prefill-only request
  (``schedule_batch.Req.is_prefill_only``) that samples nothing
  (``output_ids: []``); ``meta_info.input_token_logprobs`` holds one
  ``[logprob, token_id, text]`` per position, the first ``[null, t0, null]``
  (``logprob_result_processor._process_input_token_logprobs``). A ``-inf``
  logprob reaches us as ``null`` (orjson).
- **vLLM 0.33.0**, ``POST /inference/v1/generate`` with ``token_ids`` and
  ``sampling_params.prompt_logprobs: 0``: ``max_tokens`` must be at least 1
  (``SamplingParams._verify_args``), so one token is sampled and ignored;
  the top-level ``prompt_logprobs`` holds one entry per position, the first
  ``null``, each other ``{"<id>": {"logprob", "rank", "decoded_token"}}``
  with the prompt's own token first (``v1/engine/logprobs.py``
  ``create_prompt_logprobs``); ``-inf`` is clamped to ``-9999.0``
  (``clamp_prompt_logprobs``). ``stream`` must be false: a streamed answer
  has no ``prompt_logprobs`` at all.

Both score the raw distribution (no temperature, top-p or penalties).

An engine aborts a scoring request like any other (SGLang's
``abort_request``, ``/update_weight_version`` with ``abort_all_requests``;
vLLM's ``/pause`` in abort mode): the answer says ``abort`` (SGLang
``meta_info.finish_reason.type``, tokenizer_manager.py
``TokenizerManager._handle_abort_req``; vLLM ``choices[].finish_reason``,
scale_out/token_in_token_out/serving.py ``serve_tokens_full_generator``)
and carries the scores computed so far — none when it was aborted before
its prefill (SGLang ``input_token_logprobs: []``, vLLM ``prompt_logprobs:
null``). Such an answer is `RescoreInterrupted`, not malformed: the worker
did nothing wrong, and the request can be sent again. An aborted answer
that still scores every position is used as it is (vLLM: aborted after the
prefill, while it sampled the one ignored token).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt
import orjson

from ..errors import RescoreInterrupted, UpstreamMalformed
from ..tokens import IdArray
from .answer import Logprob, decode_strictly

__all__ = [
    "SGLANG_SCORING",
    "VLLM_SCORING",
    "ScoreCheck",
    "Scores",
    "ScoringDialect",
    "check_scores",
]

ScoreArray = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Scores:
    """A worker's logprobs of a sequence's positions: one per position, NaN
    where the engine gave none (position 0 always; SGLang's ``-inf``)."""

    logprobs: ScoreArray
    weight_version: str | None  # the worker's policy version, when it names one


@dataclass(frozen=True, slots=True)
class ScoringDialect:
    path: str
    # The request's body for these ids and the worker's served model.
    body: Callable[[IdArray, str], bytes]
    # The 200 answer read strictly for the ids sent (`UpstreamMalformed`).
    read: Callable[[bytes, IdArray], Scores]


_WHAT = "worker's scoring answer"


def _malformed(detail: str, kind: str = "schema") -> UpstreamMalformed:
    return UpstreamMalformed(f"{_WHAT} {detail}", kind=kind)


def _aborted(entries: int, ids: IdArray) -> RescoreInterrupted:
    return RescoreInterrupted(
        f"the worker aborted the scoring request (finish_reason abort) with "
        f"{entries} of {len(ids)} positions scored"
    )


def _check_length(entries: int, ids: IdArray, *, aborted: bool) -> None:
    if entries != len(ids):
        if aborted:  # scored partway (SGLang's chunked prefill) or not at all
            raise _aborted(entries, ids)
        raise _malformed(f"scores {entries} positions for {len(ids)} ids sent", "length_mismatch")


def _finish(values: list[float | None], weight_version: str | None) -> Scores:
    """Scores from one value per position; position 0 must have none."""
    if values and values[0] is not None:
        raise _malformed("gives the first position a logprob (nothing precedes it)")
    logprobs = np.array([np.nan if v is None else v for v in values], np.float32)
    np.minimum(logprobs, 0.0, out=logprobs)  # float noise above 0, as for turns
    return Scores(logprobs, weight_version)


# -- SGLang -------------------------------------------------------------------


class _SGLangEntry(msgspec.Struct, array_like=True, gc=False):
    logprob: Logprob | None
    token_id: int
    text: str | None = None


class _SGLangFinish(msgspec.Struct):
    type: str


class _SGLangMeta(msgspec.Struct):
    input_token_logprobs: list[_SGLangEntry]
    completion_tokens: int
    weight_version: str | None = None
    finish_reason: _SGLangFinish | None = None


class _SGLangAnswer(msgspec.Struct):
    output_ids: list[int]
    meta_info: _SGLangMeta


_SGLANG = msgspec.json.Decoder(_SGLangAnswer)


def _sglang_body(ids: IdArray, model: str) -> bytes:
    del model  # /generate serves the one model it runs
    return orjson.dumps(
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "stream": False,
            "rid": uuid.uuid4().hex,
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def _read_sglang(body: bytes, ids: IdArray) -> Scores:
    answer: _SGLangAnswer = decode_strictly(_SGLANG, body, _WHAT)
    meta = answer.meta_info
    if answer.output_ids or meta.completion_tokens:
        raise _malformed(
            f"sampled {len(answer.output_ids)} tokens; max_new_tokens was 0", "length_mismatch"
        )
    entries = meta.input_token_logprobs
    aborted = meta.finish_reason is not None and meta.finish_reason.type == "abort"
    _check_length(len(entries), ids, aborted=aborted)
    if not np.array_equal(np.fromiter((e.token_id for e in entries), np.int64, len(entries)), ids):
        raise _malformed("names other tokens than the ids sent", "token_id")
    return _finish([e.logprob for e in entries], meta.weight_version)


SGLANG_SCORING = ScoringDialect("/generate", _sglang_body, _read_sglang)


# -- vLLM ---------------------------------------------------------------------


class _VllmLogprob(msgspec.Struct, gc=False):
    logprob: Logprob
    rank: int | None = None
    decoded_token: str | None = None


class _VllmSpan(msgspec.Struct):
    version: str


class _VllmChoice(msgspec.Struct):
    weight_versions: list[_VllmSpan] | None = None
    finish_reason: str | None = None


class _VllmAnswer(msgspec.Struct):
    prompt_logprobs: list[dict[str, _VllmLogprob] | None] | None
    choices: list[_VllmChoice]


_VLLM = msgspec.json.Decoder(_VllmAnswer)


def _vllm_body(ids: IdArray, model: str) -> bytes:
    return orjson.dumps(
        {
            "request_id": uuid.uuid4().hex,
            "token_ids": ids,
            "model": model,
            "output_mode": "tokens",
            "stream": False,  # a streamed answer carries no prompt_logprobs
            # One token must be sampled (max_tokens >= 1); greedy, and ignored.
            "sampling_params": {
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
                "detokenize": False,
            },
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def _read_vllm(body: bytes, ids: IdArray) -> Scores:
    answer: _VllmAnswer = decode_strictly(_VLLM, body, _WHAT)
    entries = answer.prompt_logprobs
    aborted = any(choice.finish_reason == "abort" for choice in answer.choices)
    if entries is None:
        raise _aborted(0, ids) if aborted else _malformed("has no prompt_logprobs")
    _check_length(len(entries), ids, aborted=aborted)
    values: list[float | None] = []
    for position, (entry, token_id) in enumerate(zip(entries, ids.tolist(), strict=True)):
        if entry is None:
            values.append(None)
            continue
        # The prompt's own token comes first (then a top-k we did not ask for).
        first = next(iter(entry), None)
        if first != str(token_id):
            raise _malformed(
                f"scores token {first} at position {position}, where {token_id} was sent",
                "token_id",
            )
        values.append(entry[first].logprob)
    spans = answer.choices[0].weight_versions if answer.choices else None
    return _finish(values, spans[-1].version if spans else None)


VLLM_SCORING = ScoringDialect("/inference/v1/generate", _vllm_body, _read_vllm)


# -- the check a rescore's request is sent with ---------------------------------


@dataclass(frozen=True, slots=True)
class ScoreCheck:
    """What a scoring answer is checked against: the dialect's reader, the
    ids sent, and the positions that must have a logprob."""

    read: Callable[[bytes, IdArray], Scores]
    ids: IdArray
    keep: BoolArray


def check_scores(body: bytes, check: ScoreCheck) -> Scores:
    """The dialect's strict read, and a logprob at every kept position
    (`UpstreamMalformed` otherwise; `RescoreInterrupted` for an abort)."""
    scores = check.read(body, check.ids)
    missing = np.flatnonzero(check.keep & np.isnan(scores.logprobs))
    if len(missing):
        raise _malformed(
            f"gave no logprob for position {int(missing[0])} of {len(check.ids)}", "missing"
        )
    return scores
