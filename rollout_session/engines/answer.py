"""What every engine's answer check shares (docs/api.md#answer).

A worker's 200 is read by a typed msgspec decoder that keeps only the fields
a turn needs and refuses, by itself, ``NaN``/``Infinity`` constants,
bool-as-int, bool-as-float, float or string token ids, out-of-range floats,
positive logprobs beyond `LOGPROB_EPSILON` and ids outside
``0 ≤ id < vocab_size`` (`Logprob`, `token_id`). Each engine's ``answer``
module builds its own decoder from these pieces and checks what msgspec
cannot express (lengths, the prompt count) against an `AnswerCheck`.

Everything here is picklable and touches no session state: answer checks
run in validation processes, which import an engine's ``answer`` module and
this one, nothing of the web stack.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import pybase64

from ..errors import UpstreamMalformed

if TYPE_CHECKING:
    from .base import EngineRequest

__all__ = [
    "LOGPROB_EPSILON",
    "AnswerCheck",
    "Logprob",
    "decode_routed_experts",
    "decode_strictly",
    "token_id",
]

# Logprobs are ≤ 0; allow float noise from the sampler's log-softmax (an
# engine's answer clamps it to 0 before it is stored).
LOGPROB_EPSILON = 1e-4

# A sampled or scored token's logprob as a decoder field: finite, ≤ epsilon.
Logprob = Annotated[float, msgspec.Meta(le=LOGPROB_EPSILON)]


def token_id(vocab_size: int) -> Any:
    """A token id as a decoder field: an int (not a bool), ``0 ≤ id < vocab_size``."""
    return Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]


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
