"""Placement policies, and the pins `Placer` keeps, without HTTP."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from rollout_session.engines.pool.membership import Membership
from rollout_session.engines.pool.placement import (
    ConsistentHash,
    Placer,
    RoundRobin,
    StickyLeastLoaded,
    make_placement,
)
from rollout_session.engines.pool.worker import Circuit, Health
from rollout_session.errors import NoHealthyWorker
from tests.unit.engines.pool.parts import Session, options


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


# --- Placer: the pins -------------------------------------------------------


def placer() -> tuple[Membership, Placer, list[tuple[str, str]]]:
    """A placer over three healthy members; `moved` records (worker, session)."""
    members = Membership(options(), httpx.create_ssl_context(trust_env=False))
    for port in (9001, 9002, 9003):
        members.add(f"http://127.0.0.1:{port}").health = Health.HEALTHY
    moved: list[tuple[str, str]] = []
    return members, Placer(members, options(), lambda url, sid: moved.append((url, sid))), moved


def test_a_session_keeps_its_pin_and_moves_when_its_worker_cannot_take_it() -> None:
    _, pins, moved = placer()
    session = Session("s1")
    first = pins.pin(session)
    assert session.worker == first.url and first.active_sessions == 1
    assert pins.pin(session) is first and first.active_sessions == 1  # kept
    first.draining = True
    second = pins.pin(session)
    assert second is not first and session.worker == second.url
    assert (first.active_sessions, second.active_sessions) == (0, 1)
    assert moved == [(first.url, "s1")]  # its KV there is dead weight now


def test_released_sessions_are_unpinned_once() -> None:
    _, pins, moved = placer()
    session = Session("s1")
    worker = pins.pin(session)
    pins.release(session)
    pins.release(session)  # an expired session collected later
    assert session.worker is None and worker.active_sessions == 0
    assert moved == [(worker.url, "s1")]
    restored = Session("s2", worker=worker.url)
    pins.adopt(restored)  # a journal replay counts its pin
    assert worker.active_sessions == 1


def test_no_eligible_worker_is_no_healthy_worker_with_the_next_round_as_retry() -> None:
    members, pins, _ = placer()
    for worker in members.workers.values():
        worker.circuit = Circuit.OPEN
    with pytest.raises(NoHealthyWorker) as refused:
        pins.pin(Session("s1"))
    assert refused.value.headers["Retry-After"] == "5"  # the health interval


def test_a_scorer_is_named_or_chosen_and_pins_nothing() -> None:
    members, pins, _ = placer()
    url = "http://127.0.0.1:9002"
    assert pins.scorer(url, "s1") == url
    assert pins.scorer(None, "s1") in members.workers
    assert all(w.active_sessions == 0 for w in members.workers.values())
    members.get(url).draining = True
    with pytest.raises(NoHealthyWorker, match=r"cannot take requests now .*draining"):
        pins.scorer(url, "s1")
