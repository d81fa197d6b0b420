"""Placement policies, without HTTP."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rollout_session.engines.pool.placement import (
    ConsistentHash,
    RoundRobin,
    StickyLeastLoaded,
    make_placement,
)


@dataclass
class Load:
    url: str
    active_sessions: int = 0
    inflight: int = 0


def test_sticky_keeps_the_pin_and_fills_the_least_loaded() -> None:
    workers = [Load("a", 3, 0), Load("b", 1, 5), Load("c", 1, 2)]
    policy = StickyLeastLoaded()
    assert policy.choose("s", "a", workers).url == "a"
    assert policy.choose("s", None, workers).url == "c"  # tie on sessions → fewer in flight
    assert policy.choose("s", "gone", workers).url == "c"


def test_consistent_hash_moves_about_a_quarter_when_a_fourth_worker_joins() -> None:
    policy = ConsistentHash()
    three = [Load("http://w1"), Load("http://w2"), Load("http://w3")]
    four = [*three, Load("http://w4")]
    sessions = [f"session-{i}" for i in range(4000)]
    before = {s: policy.choose(s, None, three).url for s in sessions}
    after = {s: policy.choose(s, None, four).url for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert 0.17 <= len(moved) / len(sessions) <= 0.33
    assert all(after[s] == "http://w4" for s in moved)  # only onto the new worker
    shares = [list(after.values()).count(w.url) / len(sessions) for w in four]
    assert all(0.15 <= share <= 0.35 for share in shares)


def test_round_robin_has_no_affinity() -> None:
    policy = RoundRobin()
    workers = [Load("a"), Load("b")]
    assert [policy.choose("s", "a", workers).url for _ in range(4)] == ["a", "b", "a", "b"]


def test_unknown_placement() -> None:
    with pytest.raises(ValueError, match="unknown placement"):
        make_placement("random")
