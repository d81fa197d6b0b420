"""Prometheus metrics (``GET /metrics``), one registry per app.

Event counters and histograms are updated where things happen; state that
already lives elsewhere (sessions by state, worker health and load, journal
lag) is read at scrape time by a collector, so there is no second copy to
keep in sync.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engines.base import Engine
from ..engines.pool import Circuit, WorkerPool
from ..session.session import SessionState
from ..session.store import SessionStore
from ..turn.metrics import TurnMetrics

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# The engine's pool and the engine, once start-up chose them (None before).
EngineParts = Callable[[], "tuple[WorkerPool, Engine] | None"]


class _StateCollector(Collector):
    def __init__(self, store: SessionStore, engine: EngineParts) -> None:
        self._store, self._engine = store, engine

    def collect(self) -> Iterator[Metric]:
        store = self._store
        sessions = GaugeMetricFamily(
            "rollout_sessions", "Sessions held, by state", labels=["state"]
        )
        tally = Tally(s.state.value for s in store.registry)
        tally[SessionState.COLLECTED.value] = len(store.registry.collected())
        for state in SessionState:
            sessions.add_metric([state.value], tally[state.value])
        yield sessions
        parts = self._engine()
        if parts is not None:
            yield from self._engine_metrics(*parts)
        yield from self._journal_metrics()

    @staticmethod
    def _engine_metrics(pool: WorkerPool, engine: Engine) -> Iterator[Metric]:
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
        excused = CounterMetricFamily(
            "rollout_worker_circuit_excused",
            "Times failed turns would have opened its circuit but its probe passed "
            "(taken as the requests' fault)",
            labels=["worker"],
        )
        paused = CounterMetricFamily(
            "rollout_worker_paused_refusals",
            "Requests it refused because its trainer paused it: waited for its resume "
            "and sent again (never a failure)",
            labels=["worker"],
        )
        for worker in pool.workers.values():
            healthy.add_metric([worker.url], float(worker.healthy))
            fenced.add_metric([worker.url], float(worker.circuit is not Circuit.CLOSED))
            inflight.add_metric([worker.url], worker.inflight)
            pinned.add_metric([worker.url], worker.active_sessions)
            excused.add_metric([worker.url], worker.circuit_excused)
            paused.add_metric([worker.url], worker.paused_refusals)
        yield from (healthy, fenced, inflight, pinned, excused, paused)
        control = CounterMetricFamily(
            "rollout_control_failures",
            "Best-effort control calls to workers that failed (logged once per worker and call)",
            labels=["call"],
        )
        for call, count in sorted(pool.control_failures.items()):
            control.add_metric([call], count)
        yield control
        for counter in engine.counters():
            family = CounterMetricFamily(counter.name, counter.help, labels=list(counter.labels))
            for values, count in counter.values.items():
                family.add_metric(list(values), count)
            yield family

    def _journal_metrics(self) -> Iterator[Metric]:
        journal = self._store.journal
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


class Metrics(TurnMetrics):
    """The app's registry: the turns' counters, and the state gauges read at
    scrape time from the store, the pool and the engine's own counters."""

    def __init__(self, store: SessionStore, engine: EngineParts) -> None:
        """`engine`: the pool and engine start-up chose (None until then)."""
        self.registry = CollectorRegistry()
        super().__init__(self.registry)
        self.registry.register(_StateCollector(store, engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
