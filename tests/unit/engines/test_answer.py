"""What every engine's answer check shares: the decoder fields (`Logprob`,
`token_id`), the strict decode, and the routed-experts check."""

from __future__ import annotations

import base64
import pickle
from typing import Any

import msgspec
import numpy as np
import pytest

from rollout_session.engines.answer import (
    LOGPROB_EPSILON,
    AnswerCheck,
    Logprob,
    decode_routed_experts,
    decode_strictly,
    token_id,
)
from rollout_session.engines.base import EngineRequest
from rollout_session.errors import UpstreamMalformed


class Entry(msgspec.Struct, array_like=True):
    logprob: Logprob
    token: token_id(10)  # type: ignore[valid-type]


DECODER = msgspec.json.Decoder(list[Entry])


@pytest.mark.parametrize(
    "body",
    [b"[[-0.5, 3]]", b"[[0.0, 0]]", f"[[{LOGPROB_EPSILON}, 9]]".encode()],
    ids=["plain", "zero", "epsilon"],
)
def test_a_sample_decodes(body: bytes) -> None:
    (entry,) = decode_strictly(DECODER, body)
    assert entry.logprob <= LOGPROB_EPSILON and 0 <= entry.token < 10


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b"[[0.5, 3]]", "schema"),
        (b"[[NaN, 3]]", "json"),
        (b"[[-0.5, 10]]", "schema"),
        (b"[[-0.5, -1]]", "schema"),
        (b"[[-0.5, true]]", "schema"),
        (b"[[true, 3]]", "schema"),
        (b"[[-0.5, 3.0]]", "schema"),
        (b'[[-0.5, "3"]]', "schema"),
        (b"[[-0.5, 3]", "json"),
    ],
    ids=[
        "positive",
        "nan",
        "id-at-vocab",
        "negative-id",
        "bool-id",
        "bool-logprob",
        "float-id",
        "string-id",
        "truncated",
    ],
)
def test_what_cannot_be_a_sample_is_malformed(body: bytes, kind: str) -> None:
    with pytest.raises(UpstreamMalformed) as refused:
        decode_strictly(DECODER, body, "test answer")
    assert refused.value.kind == kind
    assert refused.value.message.startswith("test answer ")


def test_the_check_of_a_request_is_its_prompt_vocabulary_and_experts() -> None:
    request = EngineRequest(
        params={},
        input_ids=np.arange(7, dtype=np.int32),
        template_kwargs={},
        vocab_size=100,
        experts_from=6,
        experts_width=8,
    )
    check = AnswerCheck.of(request)
    assert check == AnswerCheck(
        sent_prompt_tokens=7, vocab_size=100, experts_from=6, experts_width=8
    )
    assert pickle.loads(pickle.dumps(check)) == check  # it travels to validation processes


def blob(values: list[int]) -> str:
    return base64.b64encode(np.array(values, "<i4").tobytes()).decode()


def test_routed_experts_of_new_positions_are_decoded_with_their_width() -> None:
    decoded = decode_routed_experts(blob([1, 2, 3, 4, 5, 6]), positions=3, width=None)
    assert decoded is not None
    data, width = decoded
    assert width == 2 and np.frombuffer(data, "<i4").tolist() == [1, 2, 3, 4, 5, 6]
    assert decode_routed_experts(blob([]), positions=0, width=None) is None
    assert decode_routed_experts(blob([]), positions=0, width=2) == (b"", 2)


@pytest.mark.parametrize(
    ("value", "positions", "width", "message"),
    [
        (None, 2, None, "has no routed_experts although --routed-experts asked"),
        (None, 2, 4, "stopped sending routed_experts"),
        ("%%%", 2, None, "not base64"),
        (base64.b64encode(b"abc").decode(), 1, None, "3 bytes for 1 positions"),
        (blob([1, 2, 3]), 2, None, "12 bytes for 2 positions"),
        (blob([1, 2, 3, 4]), 2, 1, "width changed from 1 to 2"),
        (blob([1]), 0, None, "4 bytes for 0 positions"),
    ],
    ids=["missing", "stopped", "not-base64", "not-int32", "uneven", "width", "none-asked"],
)
def test_routed_experts_that_do_not_fit_are_malformed(
    value: Any, positions: int, width: int | None, message: str
) -> None:
    with pytest.raises(UpstreamMalformed, match=message) as refused:
        decode_routed_experts(value, positions=positions, width=width)
    assert refused.value.kind == "routed_experts"
