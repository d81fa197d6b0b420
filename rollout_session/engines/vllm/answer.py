"""Strict validation of a vLLM worker's ``/inference/v1/generate`` answer.

vLLM 0.33 answers a non-streamed ``output_mode: "derender"`` request with a
``GenerateDerenderResponse`` (entrypoints/scale_out/token_in_token_out/
protocol.py; docs/research/vllm-0.33-generate-answer.md §1): one choice with
``token_ids`` (through the stop token), one logprob entry per id, the
message vLLM's parsers made of the text, ``weight_versions`` spans over the
output, and ``routed_experts`` when the worker runs with
``--enable-return-routed-experts``. A typed msgspec decoder refuses what
cannot be a sample (non-finite or positive logprobs, ids outside the
vocabulary, bool-as-int); lengths, the prompt count, vLLM's ``-9999.0``
stand-in for a missing logprob and the spans are checked after. Everything
here is picklable: it may run in a worker process.
"""

from __future__ import annotations

import binascii
import functools
import io
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import pybase64

from ...errors import UpstreamMalformed
from ...tokens import IdArray, LogprobArray
from ..answer import AnswerCheck, Logprob, decode_strictly, token_id

__all__ = [
    "Derendered",
    "VllmAnswer",
    "check_derendered",
    "check_vllm_answer",
    "check_vllm_probe",
    "decode_npy_experts",
]

# _clamp_logprob (token_in_token_out/serving.py): -inf and NaN are sent as
# this, and a sampled token without a logprob entry gets it too. A sample
# has a real logprob: this is refused, not stored.
_MISSING_LOGPROB = -9999.0


class _Function(msgspec.Struct):
    name: str
    arguments: str


class _ToolCall(msgspec.Struct):
    id: str
    function: _Function
    type: str = "function"


class _Message(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolCall] = []


class _Span(msgspec.Struct):
    version: str
    start: int
    end: int


class _Cached(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: _Cached | None = None


def _structs(vocab_size: int, mode: str) -> type[msgspec.Struct]:
    TokenId = token_id(vocab_size)
    # Derender/text entries carry the token's text; tokens entries its id.
    Entry = msgspec.defstruct(
        "Entry", [("logprob", Logprob), ("token", str | None, None)], gc=False
    )
    Logprobs = msgspec.defstruct("Logprobs", [("content", list[Entry])])  # type: ignore[valid-type]
    fields: list[Any] = [
        ("finish_reason", str),
        ("token_ids", list[TokenId]),  # type: ignore[valid-type]
        ("logprobs", Logprobs),
        ("stop_reason", int | str | None, None),
        ("routed_experts", str | None, None),
        ("weight_versions", list[_Span] | None, None),
    ]
    if mode == "derender":
        fields.append(("message", _Message))
    Choice = msgspec.defstruct("Choice", fields, kw_only=True)
    return msgspec.defstruct(
        "VllmAnswer",
        [
            ("choices", Annotated[list[Choice], msgspec.Meta(min_length=1, max_length=1)]),  # type: ignore[valid-type]
            ("usage", _Usage),
            ("output_mode", Literal[mode], mode),
            ("model", str | None, None),
        ],
    )


@functools.cache
def _decoder(vocab_size: int, mode: str) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(_structs(vocab_size, mode))


@dataclass(slots=True, frozen=True)
class VllmAnswer:
    ids: IdArray
    logprobs: LogprobArray
    token_texts: list[str | None]  # each sampled token's text, as the worker decoded it
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    stop_reason: int | str | None
    prompt_tokens: int
    cached_tokens: int | None
    model: str | None
    weight_versions: list[dict[str, Any]]  # spans tiling the output, in order
    experts: tuple[bytes, int] | None

    @property
    def weight_version(self) -> str | None:
        """vLLM's label of the weights that sampled the last token ("default"
        until the trainer names a version); None for an empty output."""
        return self.weight_versions[-1]["version"] if self.weight_versions else None


def _decode(body: bytes, vocab_size: int, mode: str) -> Any:
    return decode_strictly(_decoder(vocab_size, mode), body)


def _checked_lengths(answer: Any, sent_prompt_tokens: int) -> tuple[Any, IdArray, LogprobArray]:
    choice = answer.choices[0]
    entries = choice.logprobs.content
    n = len(choice.token_ids)
    if not (len(entries) == n == answer.usage.completion_tokens):
        raise UpstreamMalformed(
            f"worker sent {len(entries)} logprobs and {n} token_ids for "
            f"completion_tokens={answer.usage.completion_tokens}",
            kind="length_mismatch",
        )
    if answer.usage.prompt_tokens != sent_prompt_tokens:
        raise UpstreamMalformed(
            f"worker reports prompt_tokens={answer.usage.prompt_tokens} but was sent "
            f"{sent_prompt_tokens} token_ids",
            kind="prompt_tokens_mismatch",
        )
    logprobs = np.fromiter((e.logprob for e in entries), np.float32, n)
    if n and float(logprobs.min()) <= _MISSING_LOGPROB:
        raise UpstreamMalformed(
            "worker sent -9999.0 (vLLM's stand-in for a missing or infinite logprob) for a "
            "sampled token",
            kind="logprob",
        )
    np.minimum(logprobs, 0.0, out=logprobs)
    return choice, np.asarray(choice.token_ids, dtype=np.int32), logprobs


def _spans(spans: list[_Span] | None, n: int) -> list[dict[str, Any]]:
    """weight_versions must tile [0, n) in order (WeightVersionSpan)."""
    if spans is None:
        return []
    at = 0
    for span in spans:
        if span.start != at or span.end <= span.start:
            raise UpstreamMalformed(
                f"weight_versions do not tile the {n} output tokens in order",
                kind="weight_versions",
            )
        at = span.end
    if at != n:
        raise UpstreamMalformed(
            f"weight_versions cover {at} of the {n} output tokens", kind="weight_versions"
        )
    return [{"start": s.start, "end": s.end, "version": s.version} for s in spans]


_EXPERT_DTYPES = frozenset(np.dtype(t) for t in ("u1", "<u2", ">u2", "<i4", ">i4"))


def decode_npy_experts(
    blob: str | None, *, positions: int, width: int | None
) -> tuple[bytes, int] | None:
    """vLLM's routed experts: base64 of ``.npy`` bytes (numpy2base64), shape
    (positions, layers, top_k), uint8/uint16/int32. Returns little-endian
    int32 bytes and values per position; refuses anything else."""
    if blob is None:
        if width is not None:
            raise UpstreamMalformed("worker stopped sending routed_experts", kind="routed_experts")
        raise UpstreamMalformed(
            "worker answer has no routed_experts although --routed-experts asked for them "
            "(a MoE model served by vLLM with --enable-return-routed-experts is needed)",
            kind="routed_experts",
        )
    try:
        data = pybase64.b64decode(blob, validate=True)
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError):
        raise UpstreamMalformed(
            "routed_experts is not a base64 .npy array", kind="routed_experts"
        ) from None
    # Only what vLLM sends (RoutedExpertsCapturer: uint8/uint16, an int32
    # buffer): a wider dtype could hold ids the int32 store would wrap.
    if array.ndim != 3 or array.dtype not in _EXPERT_DTYPES or array.shape[0] != positions:
        raise UpstreamMalformed(
            f"routed_experts has shape {array.shape} ({array.dtype}) for {positions} positions",
            kind="routed_experts",
        )
    per = int(array.shape[1] * array.shape[2])
    if not positions:
        return None if width is None else (b"", width)
    if width is not None and per != width:
        raise UpstreamMalformed(
            f"routed_experts width changed from {width} to {per}", kind="routed_experts"
        )
    return array.astype("<i4", copy=False).tobytes(), per


def check_vllm_answer(body: bytes, check: AnswerCheck) -> VllmAnswer:
    """Decode and check a derender 200 body; raise `UpstreamMalformed` if bad."""
    answer = _decode(body, check.vocab_size, "derender")
    choice, ids, logprobs = _checked_lengths(answer, check.sent_prompt_tokens)
    experts = None
    if check.experts_from is not None:
        experts = decode_npy_experts(
            choice.routed_experts,
            positions=check.sent_prompt_tokens + len(ids) - 1 - check.experts_from,
            width=check.experts_width,
        )
    message = choice.message
    details = answer.usage.prompt_tokens_details
    return VllmAnswer(
        ids=ids,
        logprobs=logprobs,
        token_texts=[e.token for e in choice.logprobs.content],
        content=message.content,
        reasoning=message.reasoning,
        tool_calls=_tool_calls(message),
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
        prompt_tokens=answer.usage.prompt_tokens,
        cached_tokens=details.cached_tokens if details is not None else None,
        model=answer.model,
        weight_versions=_spans(choice.weight_versions, len(ids)),
        experts=experts,
    )


def check_vllm_probe(body: bytes) -> object:
    """A one-token ``output_mode: "tokens"`` answer to the pool's probe."""
    answer = _decode(body, 2**31 - 1, "tokens")
    return _checked_lengths(answer, 1)


class _DerenderedChoice(msgspec.Struct):
    message: _Message
    finish_reason: str | None = None


class _DerenderedAnswer(msgspec.Struct):
    choices: Annotated[list[_DerenderedChoice], msgspec.Meta(min_length=1, max_length=1)]


@dataclass(slots=True, frozen=True)
class Derendered:
    """vLLM's parse of a stitched completion (``/v1/chat/completions/derender``)."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str


def check_derendered(body: bytes) -> Derendered:
    """The message and finish reason of a derender 200 body (the ids,
    logprobs and usage are the token route's, already checked)."""
    try:
        answer = msgspec.json.decode(body, type=_DerenderedAnswer)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise UpstreamMalformed(
            f"derender answer failed validation: {exc}", kind="schema"
        ) from None
    choice = answer.choices[0]
    if choice.finish_reason is None:
        raise UpstreamMalformed("derender answer has no finish_reason", kind="finish_reason")
    return Derendered(
        content=choice.message.content,
        reasoning=choice.message.reasoning,
        tool_calls=_tool_calls(choice.message),
        finish_reason=choice.finish_reason,
    )


def _tool_calls(message: _Message) -> list[dict[str, Any]]:
    return [
        {
            "id": call.id,
            "index": i,
            "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments},
        }
        for i, call in enumerate(message.tool_calls)
    ]
