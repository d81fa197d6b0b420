"""The trainer's sampling pinned on a session: what `POST /sessions` takes,
and what a turn's request becomes under it, conflicts counted or refused."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.errors import InvalidRequest
from rollout_session.turn.request import chat_request
from rollout_session.turn.sampling import Conflict, OnSamplingConflict, parse_sampling, pin

USER = [{"role": "user", "content": "hi"}]


def request(**params: Any) -> Any:
    return chat_request({"messages": USER, **params})


def test_none_pins_nothing() -> None:
    assert parse_sampling(None) is None
    asked = request(temperature=0.7)
    assert pin(asked, None, OnSamplingConflict.REFUSE) == (asked, [])


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ([1], "sampling"),
        ({"temperature": "1"}, "sampling.temperature"),
        ({"temperature": True}, "sampling.temperature"),
        ({"temperature": 3.0}, "sampling.temperature"),
        ({"top_k": 1.5}, "sampling.top_k"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"logit_bias": {}}, "sampling.logit_bias"),
        ({"top_p": float("nan")}, "sampling.top_p"),
    ],
    ids=["not-object", "string", "bool", "range", "float-k", "zero-cap", "unknown", "nan"],
)
def test_a_bad_sampling_is_refused_naming_the_key(sampling: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_sampling(sampling)
    assert refused.value.param == param


def test_the_sessions_values_are_sent_whatever_the_agent_asks() -> None:
    pinned = parse_sampling({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 7})
    got, conflicts = pin(request(temperature=0.7, top_p=1.0), pinned, OnSamplingConflict.OVERRIDE)
    assert {k: got.raw[k] for k in ("temperature", "top_p", "top_k", "seed")} == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": 7,
    }
    # Only a value the agent set, and set otherwise, is a conflict.
    assert conflicts == [Conflict("temperature", 0.7, 1.0)]


@pytest.mark.parametrize(
    ("asked", "limit", "conflict"),
    [
        ({}, 64, None),
        ({"max_tokens": 16}, 16, None),
        ({"max_tokens": 500}, 64, Conflict("max_tokens", 500, 64)),
        ({"max_completion_tokens": 500}, 64, Conflict("max_completion_tokens", 500, 64)),
    ],
    ids=["none-takes-the-cap", "smaller-stands", "larger-is-capped", "completion-tokens"],
)
def test_max_tokens_is_a_cap(asked: dict[str, Any], limit: int, conflict: Conflict | None) -> None:
    got, conflicts = pin(request(**asked), {"max_tokens": 64}, OnSamplingConflict.OVERRIDE)
    assert got.max_tokens == limit
    assert got.raw.get("max_tokens", limit) == limit
    assert conflicts == ([] if conflict is None else [conflict])


def test_under_refuse_a_conflict_is_a_400_naming_it() -> None:
    with pytest.raises(InvalidRequest, match=r"temperature=0\.7 conflicts") as refused:
        pin(request(temperature=0.7), {"temperature": 1.0}, OnSamplingConflict.REFUSE)
    assert refused.value.param == "temperature"
    # The session's own value, or none, is no conflict.
    for asked in (request(temperature=1.0), request()):
        got, conflicts = pin(asked, {"temperature": 1.0}, OnSamplingConflict.REFUSE)
        assert got.raw["temperature"] == 1.0 and conflicts == []
