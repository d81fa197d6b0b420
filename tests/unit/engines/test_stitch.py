"""A continuation stitched onto the partial completion it continues, and the
version spans a worker reports (engines/stitch.py, EngineRequest.continued)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollout_session.engines.base import EngineRequest, Partial
from rollout_session.engines.stitch import stitch, version_spans
from rollout_session.errors import UpstreamMalformed
from rollout_session.tokens import VersionSpan


def ids(*values: int) -> Any:
    return np.array(values, np.int32)


def lps(*values: float) -> Any:
    return np.array(values, np.float32)


def request(**kw: Any) -> EngineRequest:
    fields: dict[str, Any] = {
        "params": {"messages": [], "max_tokens": 10, "min_tokens": 4},
        "input_ids": ids(1, 2, 3),
        "template_kwargs": {},
        "vocab_size": 100,
        "max_tokens": 10,
        "experts_from": 0,
        "experts_width": None,
        **kw,
    }
    return EngineRequest(**fields)


PARTIAL = Partial(
    ids(7, 8), lps(-0.5, -0.25), (VersionSpan(0, 2, "v1"),), (b"\x01" * 8 * 2, 2), "state"
)


def test_continued_counts_the_partial_against_every_limit() -> None:
    nxt = request().continued(PARTIAL)
    assert nxt.input_ids.tolist() == [1, 2, 3, 7, 8]
    assert nxt.params["max_tokens"] == 8
    assert nxt.params["min_tokens"] == 2
    assert nxt.max_tokens == 8
    # The aborted answer reported positions 0..3 (its last token, 8, was never forwarded).
    assert nxt.experts_from == 4
    assert nxt.experts_width == 2
    assert nxt.partial is PARTIAL


def test_continued_leaves_absent_limits_absent() -> None:
    nxt = request(params={"messages": []}, max_tokens=None, experts_from=None).continued(PARTIAL)
    assert "max_tokens" not in nxt.params and "min_tokens" not in nxt.params
    assert nxt.max_tokens is None and nxt.experts_from is None


def test_stitch_puts_the_partial_first() -> None:
    nxt = request().continued(PARTIAL)
    got_ids, got_lps, spans, experts = stitch(
        nxt, ids(9), lps(-1.0), (VersionSpan(0, 1, "v2"),), (b"\x02" * 8, 2)
    )
    assert got_ids.tolist() == [7, 8, 9]
    assert got_lps.tolist() == [-0.5, -0.25, -1.0]
    assert spans == (VersionSpan(0, 2, "v1"), VersionSpan(2, 3, "v2"))
    assert experts == (b"\x01" * 16 + b"\x02" * 8, 2)


def test_stitch_without_partial_is_the_answer() -> None:
    answer = (ids(9), lps(-1.0), (VersionSpan(0, 1, "v2"),), None)
    assert stitch(request(), *answer) == answer


@pytest.mark.parametrize(
    ("reported", "version", "n", "want"),
    [
        (None, "v1", 3, (VersionSpan(0, 3, "v1"),)),
        (None, None, 0, ()),
        ([{"version": "a", "start": 0, "end": 0}], "a", 0, ()),
        (
            [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 5}],
            "b",
            5,
            (VersionSpan(0, 2, "a"), VersionSpan(2, 5, "b")),
        ),
    ],
    ids=["one-version", "nothing-sampled", "sglang-empty-span", "two-spans"],
)
def test_version_spans(
    reported: list[dict[str, Any]] | None, version: str | None, n: int, want: Any
) -> None:
    assert version_spans(reported, version, n) == want


@pytest.mark.parametrize(
    "reported",
    [
        [{"version": "a", "start": 0, "end": 2}],
        [{"version": "a", "start": 1, "end": 3}],
        [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 1, "end": 3}],
        [{"version": 5, "start": 0, "end": 3}],
        [{"version": "a", "start": True, "end": 3}],
    ],
    ids=["short", "gap-at-start", "overlap", "version-not-string", "bool-start"],
)
def test_version_spans_refuses_what_does_not_tile(reported: list[dict[str, Any]]) -> None:
    with pytest.raises(UpstreamMalformed):
        version_spans(reported, "a", 3)
