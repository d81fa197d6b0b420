"""Strict validation of a worker's 200 answer (docs/api.md#answer).

A typed msgspec decoder reads only the fields we need and rejects, by itself,
``NaN``/``Infinity`` constants, bool-as-int, bool-as-float, float or string
token ids, out-of-range floats, positive logprobs (beyond a tiny epsilon) and
ids outside ``0 ≤ id < vocab_size``. What msgspec cannot express (length
agreement, prompt token count) is checked here after decoding. Anything that
fails is `UpstreamMalformed`: nothing of that turn is committed.

Decoding is CPU-bound and holds the GIL, so the server runs `check_answer`
for large bodies in a worker process: everything here is picklable (the
arguments, `WorkerAnswer`, the error) and nothing touches session state.
"""

from __future__ import annotations

import binascii
import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np
import pybase64

from ...errors import UpstreamMalformed
from ...tokens import IdArray, LogprobArray

if TYPE_CHECKING:
    from ..base import EngineRequest

__all__ = [
    "AnswerCheck",
    "WorkerAnswer",
    "answer_decoder",
    "check_answer",
    "decode_cost",
    "decode_routed_experts",
    "decode_strictly",
    "parse_worker_answer",
]

# Logprobs are ≤ 0; allow float noise from the sampler's log-softmax.
LOGPROB_EPSILON = 1e-4


class _Function(msgspec.Struct):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(msgspec.Struct):
    function: _Function
    id: str | None = None


class _Message(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None
    reasoning_content: str | None = None


class _FinishReason(msgspec.Struct):
    type: str


def _structs(vocab_size: int) -> type[msgspec.Struct]:
    """Build the answer type for one vocabulary (the id bound is part of it)."""
    Logprob = Annotated[float, msgspec.Meta(le=LOGPROB_EPSILON)]
    TokenId = Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]

    # array_like: an entry is [logprob, id, text?]; only the two fields we use
    # are decoded, trailing elements are skipped
    # (docs/performance.md#decode-only-what-is-used). gc=False: an entry holds
    # only a float and an int, so the collector never needs to track them.
    Entry = msgspec.defstruct(
        "Entry", [("logprob", Logprob), ("token_id", TokenId)], array_like=True, gc=False
    )
    MetaInfo = msgspec.defstruct(
        "MetaInfo",
        [
            ("output_token_logprobs", list[Entry]),  # type: ignore[valid-type]
            ("completion_tokens", int),
            ("prompt_tokens", int | None, None),
            ("cached_tokens", int | None, None),
            ("finish_reason", _FinishReason | None, None),
            ("weight_version", str | None, None),
            # Set when the answer spans a version change (SGLang 0.5.23:
            # utils/weight_versions.add_weight_versions_to_meta_info).
            ("weight_versions", list[dict[str, Any]] | None, None),
            ("routed_experts", str | None, None),
        ],
    )
    Choice = msgspec.defstruct(
        "Choice",
        [
            ("message", _Message),
            ("finish_reason", str | None, None),
            ("meta_info", MetaInfo | None, None),
        ],
    )
    return msgspec.defstruct(
        "Answer",
        [
            ("choices", Annotated[list[Choice], msgspec.Meta(min_length=1)]),  # type: ignore[valid-type]
            ("meta_info", MetaInfo | None, None),
            ("model", str | None, None),
        ],
    )


@functools.cache
def answer_decoder(vocab_size: int) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(_structs(vocab_size))


def decode_strictly(
    decoder: msgspec.json.Decoder[Any], body: bytes, what: str = "worker answer"
) -> Any:
    """`body` by a typed decoder, or `UpstreamMalformed` (kind ``schema``
    or ``json``) naming `what` failed and why."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise UpstreamMalformed(f"{what} failed validation: {exc}", kind="schema") from None
    except msgspec.DecodeError as exc:
        raise UpstreamMalformed(f"{what} is not valid JSON: {exc}", kind="json") from None


@dataclass(slots=True, frozen=True)
class WorkerAnswer:
    """What a validated answer contributes to the trajectory and history."""

    ids: IdArray
    logprobs: LogprobArray
    content: str | None
    tool_calls: list[dict[str, Any]]
    reasoning_content: str | None
    finish_reason: str | None
    cached_tokens: int | None
    weight_version: str | None
    model: str | None
    # Base64 routed-expert ids for the positions asked for (R3), unparsed.
    routed_experts: str | None = None
    weight_versions: list[dict[str, Any]] | None = None  # SGLang's spans, if sent


_EXPERTS_KEY = b'"routed_experts":"'


def decode_cost(body: bytes, *, experts: bool) -> int:
    """The bytes of `body` that cost decode time: all but the routed-experts
    string, which is looked for only when `experts` were asked for.

    Decoding costs per JSON value, not per byte: the logprob entries cost
    far more than a long base64 string of the same size. Where an answer is
    validated (loop or process) is decided on this; a miss (other spacing,
    or experts not asked for) only counts the string in. Not looking saves
    a scan of the body on the loop.
    """
    if not experts:
        return len(body)
    start = body.find(_EXPERTS_KEY)
    if start < 0:
        return len(body)
    end = body.find(b'"', start + len(_EXPERTS_KEY))
    return len(body) - (end - start) if end > 0 else len(body)


@dataclass(slots=True, frozen=True)
class AnswerCheck:
    """What a worker's answer to one turn is checked against."""

    sent_prompt_tokens: int
    vocab_size: int
    # R3: routed experts are expected for new positions from this one on
    # (None: not asked for), `experts_width` values per position as before.
    experts_from: int | None = None
    experts_width: int | None = None

    @classmethod
    def of(cls, request: EngineRequest) -> AnswerCheck:
        """What an answer to `request` is checked against."""
        return cls(
            sent_prompt_tokens=len(request.input_ids),
            vocab_size=request.vocab_size,
            experts_from=request.experts_from,
            experts_width=request.experts_width,
        )


_PATH = re.compile(r"at `\$([^`]*)`")


def _kind(message: str) -> str:
    """Coarse failure class for logs and metrics, from msgspec's error path."""
    match = _PATH.search(message)
    path = match.group(1) if match else ""
    if path.endswith("][0]") and "output_token_logprobs" in path:
        return "logprob"
    if path.endswith("][1]") and "output_token_logprobs" in path:
        return "token_id"
    return path.rsplit(".", 1)[-1].split("[", 1)[0] or "schema"


def parse_worker_answer(body: bytes, *, sent_prompt_tokens: int, vocab_size: int) -> WorkerAnswer:
    """Decode and check a worker's 200 body; raise `UpstreamMalformed` if bad."""
    try:
        answer = answer_decoder(vocab_size).decode(body)
    except msgspec.ValidationError as exc:
        raise UpstreamMalformed(
            f"worker answer failed validation: {exc}", kind=_kind(str(exc))
        ) from None
    except msgspec.DecodeError as exc:
        raise UpstreamMalformed(f"worker answer is not valid JSON: {exc}", kind="json") from None
    choice = answer.choices[0]
    meta = choice.meta_info or answer.meta_info
    if meta is None:
        raise UpstreamMalformed("worker answer has no meta_info", kind="meta_info_missing")
    entries = meta.output_token_logprobs
    if len(entries) != meta.completion_tokens:
        raise UpstreamMalformed(
            f"worker sent {len(entries)} output_token_logprobs for "
            f"completion_tokens={meta.completion_tokens}",
            kind="length_mismatch",
        )
    if meta.prompt_tokens is not None and meta.prompt_tokens != sent_prompt_tokens:
        raise UpstreamMalformed(
            f"worker reports prompt_tokens={meta.prompt_tokens} but was sent "
            f"{sent_prompt_tokens} input_ids",
            kind="prompt_tokens_mismatch",
        )
    ids = np.fromiter((e.token_id for e in entries), np.int32, len(entries))
    logprobs = np.fromiter((e.logprob for e in entries), np.float32, len(entries))
    # Sampled logprobs are ≤ 0; epsilon-positive noise is clamped so the
    # stored value is a valid log-probability.
    np.minimum(logprobs, 0.0, out=logprobs)
    message = choice.message
    finish = choice.finish_reason or (meta.finish_reason.type if meta.finish_reason else None)
    return WorkerAnswer(
        ids=ids,
        logprobs=logprobs,
        content=message.content,
        tool_calls=[
            {"id": c.id, "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls or []
        ],
        reasoning_content=message.reasoning_content,
        finish_reason=finish,
        cached_tokens=meta.cached_tokens,
        weight_version=meta.weight_version,
        model=answer.model,
        routed_experts=meta.routed_experts,
        weight_versions=meta.weight_versions,
    )


def decode_routed_experts(
    blob: str | None, *, positions: int, width: int | None
) -> tuple[bytes, int] | None:
    """Check a routed-experts delta covering `positions` new positions.

    Returns (little-endian int32 bytes, values per position), or None for no
    positions before any width is known. `width` is what earlier turns had.
    An answer without the blob is refused: it was asked for, and a worker
    that cannot send it (a dense model, or SGLang started without
    ``--enable-return-routed-experts``) must not pass as one with no experts.
    """
    if blob is None:
        if width is not None:
            raise UpstreamMalformed("worker stopped sending routed_experts", kind="routed_experts")
        raise UpstreamMalformed(
            "worker answer has no routed_experts although --routed-experts asked for them "
            "(a MoE model served by SGLang with --enable-return-routed-experts is needed)",
            kind="routed_experts",
        )
    try:
        # pybase64 (SIMD), not the standard library's
        # (docs/performance.md#routed-experts-with-pybase64).
        data = pybase64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError):
        raise UpstreamMalformed("routed_experts is not base64", kind="routed_experts") from None
    values, rest = divmod(len(data), 4)
    if rest or (values == 0) != (positions == 0) or (positions and values % positions):
        raise UpstreamMalformed(
            f"routed_experts has {len(data)} bytes for {positions} positions",
            kind="routed_experts",
        )
    if not positions:
        return None if width is None else (b"", width)
    if width is not None and values // positions != width:
        raise UpstreamMalformed(
            f"routed_experts width changed from {width} to {values // positions}",
            kind="routed_experts",
        )
    return data, values // positions


def check_answer(body: bytes, check: AnswerCheck) -> tuple[WorkerAnswer, tuple[bytes, int] | None]:
    """`parse_worker_answer` plus the routed-experts check, in one call that
    can run in a worker process. The base64 blob is not returned: the decoded
    bytes are what the trajectory stores."""
    answer = parse_worker_answer(
        body, sent_prompt_tokens=check.sent_prompt_tokens, vocab_size=check.vocab_size
    )
    if check.experts_from is None:
        return answer, None
    experts = decode_routed_experts(
        answer.routed_experts,
        positions=check.sent_prompt_tokens + len(answer.ids) - 1 - check.experts_from,
        width=check.experts_width,
    )
    return dataclasses.replace(answer, routed_experts=None), experts
