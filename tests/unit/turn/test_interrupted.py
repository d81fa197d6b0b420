"""What the turn runner keeps across a worker's abort (turn/interrupted.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollout_session.engines.base import AgentReply, Completion, EngineRequest
from rollout_session.session.trajectory import Continuation
from rollout_session.tokens import VersionSpan
from rollout_session.turn.interrupted import Interruption, relabel

FIRST = EngineRequest(
    params={"messages": []},
    input_ids=np.arange(5, dtype=np.int32),
    template_kwargs={},
    vocab_size=100,
)


def completion(n: int, *, worker: str = "http://w1", cached: int | None = 4) -> Completion:
    return Completion(
        ids=np.arange(n, dtype=np.int32),
        logprobs=np.zeros(n, np.float32),
        content="",
        tool_calls=[],
        reasoning_content=None,
        finish_reason="abort",
        model=None,
        weight_versions=(VersionSpan(0, n, "v1"),) if n else (),
        cached_tokens=cached,
        experts=None,
        worker=worker,
        latency_s=0.5,
        reply=AgentReply(200, [], b"{}"),
    )


@pytest.mark.parametrize(
    ("spans", "since", "declared", "want"),
    [
        ((VersionSpan(0, 3, "default"),), 0, "v2", (VersionSpan(0, 3, "v2"),)),
        ((VersionSpan(0, 3, None),), 0, None, (VersionSpan(0, 3, None),)),
        ((VersionSpan(0, 3, "w7"),), 0, "v2", (VersionSpan(0, 3, "w7"),)),
        (
            (VersionSpan(0, 2, "v1"), VersionSpan(2, 5, "default")),
            2,
            "v2",
            (VersionSpan(0, 2, "v1"), VersionSpan(2, 5, "v2")),
        ),
        (
            (VersionSpan(0, 2, "v2"), VersionSpan(2, 5, "default")),
            2,
            "v2",
            (VersionSpan(0, 5, "v2"),),
        ),
        (
            (VersionSpan(0, 2, "default"), VersionSpan(2, 5, "default")),
            2,
            "v2",
            (VersionSpan(0, 2, "default"), VersionSpan(2, 5, "v2")),
        ),
    ],
    ids=[
        "unset-label-takes-declared",
        "nothing-declared",
        "engine-label-wins",
        "continuation-only",
        "equal-neighbours-merge",
        "partial-keeps-its-label",
    ],
)
def test_relabel(spans: Any, since: int, declared: str | None, want: Any) -> None:
    assert relabel(spans, since, declared) == want


def test_continuations_record_each_request() -> None:
    interruption = Interruption(FIRST)
    interruption.answered(completion(3))
    request = interruption.next_request(completion(3))
    assert request.partial is not None and request.input_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    interruption.answered(completion(5, worker="http://w2", cached=2))
    assert interruption.continuations == [Continuation(3, "http://w2", 8, 2, 0)]
    assert (interruption.worker, interruption.cached_tokens) == ("http://w1", 4)
    assert interruption.latency_s == 1.0
    assert interruption.reprefilled == 6


def test_nothing_sampled_sends_the_first_request_again() -> None:
    interruption = Interruption(FIRST)
    interruption.answered(completion(0))
    assert interruption.next_request(completion(0)) is FIRST
    assert interruption.continuations == [Continuation(0, "", 5, None, 0)]


def test_resample_drops_the_partial_and_says_so() -> None:
    interruption = Interruption(FIRST)
    interruption.answered(completion(3))
    request = interruption.next_request(completion(3))
    assert interruption.resample(request) is FIRST
    interruption.answered(completion(6, worker="http://w1", cached=5))
    assert interruption.continuations == [Continuation(0, "http://w1", 5, 5, 3)]
