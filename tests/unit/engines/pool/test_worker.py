"""One worker's record: who may take a pin, and the in-flight bookkeeping a
drain and an abort-mode pause rely on."""

from __future__ import annotations

import pytest

from rollout_session.engines.pool.client import WorkerClient
from rollout_session.engines.pool.worker import Circuit, Health, Worker


def worker() -> Worker:
    url = "http://127.0.0.1:1"
    return Worker(
        url=url, client=WorkerClient(url, max_connections=1, timeout_s=1.0, connect_timeout_s=1.0)
    )


@pytest.mark.parametrize(
    ("health", "circuit", "draining", "healthy", "eligible"),
    [
        (Health.HEALTHY, Circuit.CLOSED, False, True, True),
        (Health.HEALTHY, Circuit.CLOSED, True, True, False),
        (Health.JOINING, Circuit.CLOSED, False, False, False),
        (Health.UNHEALTHY, Circuit.CLOSED, False, False, False),
        (Health.HEALTHY, Circuit.OPEN, False, False, False),
        (Health.HEALTHY, Circuit.HALF_OPEN, False, False, False),
    ],
    ids=["takes-pins", "draining", "joining", "unhealthy", "open", "half-open"],
)
def test_who_takes_pins(
    health: Health, circuit: Circuit, draining: bool, healthy: bool, eligible: bool
) -> None:
    w = worker()
    w.health, w.circuit, w.draining = health, circuit, draining
    assert (w.healthy, w.eligible) == (healthy, eligible)
    assert w.summary()["healthy"] is healthy


def test_requests_in_flight_are_counted_and_idle_is_announced() -> None:
    w = worker()
    first_idle = w.idle
    w.started("a")
    w.started(None)  # not abortable: counted, not registered
    assert (w.inflight, w.requests) == (2, {"a"})
    w.finished("a")
    assert not first_idle.is_set() and w.requests == set()
    w.finished(None)
    assert w.inflight == 0
    assert first_idle.is_set()  # a drain waiting on it wakes
    assert w.idle is not first_idle and not w.idle.is_set()  # the next wait is a new event


def test_summary_is_what_get_workers_shows() -> None:
    summary = worker().summary()
    assert summary["state"] == "joining" and summary["circuit"] == "closed"
    assert set(summary) >= {
        "url",
        "healthy",
        "draining",
        "model",
        "active_sessions",
        "inflight",
        "consecutive_failures",
        "circuit_failures",
        "circuit_excused",
        "last_error",
        "last_checked_at",
        "control_failures",
    }
