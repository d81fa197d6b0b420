"""Prometheus metrics (``GET /metrics``), one registry per app.

Event counters and histograms are updated where things happen; state that
already lives elsewhere (sessions by state, worker health and load, journal
lag) is read at scrape time by a collector, so there is no second copy to
keep in sync.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engines.pool import Circuit
from ..session.session import SessionState

if TYPE_CHECKING:
    from .context import ServerContext

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], ServerContext]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        ctx = self._read()
        sessions = GaugeMetricFamily(
            "rollout_sessions", "Sessions held, by state", labels=["state"]
        )
        tally = Tally(s.state.value for s in ctx.registry)
        tally[SessionState.COLLECTED.value] = len(ctx.registry.collected())
        for state in SessionState:
            sessions.add_metric([state.value], tally[state.value])
        yield sessions
        healthy = GaugeMetricFamily(
            "rollout_worker_healthy", "1 if it takes new sessions", labels=["worker"]
        )
        fenced = GaugeMetricFamily(
            "rollout_worker_circuit_open",
            "1 while its circuit is open or half-open (failed turns fenced it)",
            labels=["worker"],
        )
        inflight = GaugeMetricFamily(
            "rollout_worker_inflight", "Requests in flight", labels=["worker"]
        )
        pinned = GaugeMetricFamily(
            "rollout_worker_active_sessions", "Sessions pinned", labels=["worker"]
        )
        for worker in ctx.pool.workers.values():
            healthy.add_metric([worker.url], float(worker.healthy))
            fenced.add_metric([worker.url], float(worker.circuit is not Circuit.CLOSED))
            inflight.add_metric([worker.url], worker.inflight)
            pinned.add_metric([worker.url], worker.active_sessions)
        yield from (healthy, fenced, inflight, pinned)
        control = CounterMetricFamily(
            "rollout_control_failures",
            "Best-effort control calls to workers that failed (logged once per worker and call)",
            labels=["call"],
        )
        for call, count in sorted(ctx.pool.control_failures.items()):
            control.add_metric([call], count)
        yield control
        journal = ctx.store.journal
        if journal is not None:
            yield GaugeMetricFamily(
                "rollout_journal_writable",
                "1 while the journal records changes; 0 from a failed write until it writes again",
                float(journal.writable),
            )
            stats = journal.stats()
            yield CounterMetricFamily(
                "rollout_journal_write_failures",
                "Failed journal writes or fsyncs (recovered from, or being retried)",
                stats.write_failures,
            )
            yield GaugeMetricFamily(
                "rollout_journal_bytes", "Size of the journal's current segment", stats.bytes
            )
            yield GaugeMetricFamily(
                "rollout_journal_dead_bytes",
                "Of it, superseded records compaction will reclaim",
                stats.dead_bytes,
            )
            pending, age = journal.lag()
            yield GaugeMetricFamily(
                "rollout_journal_pending_records", "Journal records not yet written", pending
            )
            yield GaugeMetricFamily(
                "rollout_journal_lag_seconds", "Age of the oldest unwritten record", age
            )


class Metrics:
    def __init__(self, read_context: Callable[[], ServerContext]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter(
            "rollout_turns", "Chat turns by outcome and code", ["outcome", "code"], registry=r
        )
        self.upstream_latency = Histogram(
            "rollout_upstream_latency_seconds",
            "Worker round trip of a turn",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "rollout_server_overhead_seconds",
            "Time a successful turn spent in the server, worker round trip excluded",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "rollout_tokens_committed", "Tokens committed to trajectories", ["kind"], registry=r
        )
        self.validation_failures = Counter(
            "rollout_validation_failures", "Malformed worker answers by kind", ["kind"], registry=r
        )
        self.rollbacks = Counter(
            "rollout_rollbacks",
            "Turns replaced in place (a retry, a bounded rollback): their sampled "
            "tokens left the trajectory, by reason",
            ["reason"],
            registry=r,
        )
        self.segments = Counter(
            "rollout_segments",
            "New segments started by a request that did not extend its session's "
            "current one, by reason",
            ["reason"],
            registry=r,
        )
        self.busy = Counter(
            "rollout_busy_rejections", "Turns refused with 409 session_busy", registry=r
        )
        r.register(_StateCollector(read_context))

    def render(self) -> bytes:
        return generate_latest(self.registry)
