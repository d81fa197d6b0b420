"""What turns count: outcomes, latency, tokens, rollbacks, segments
(``GET /metrics`` renders them with the server's state gauges)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["TurnMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class TurnMetrics:
    """Counters and histograms of turns, on the app's registry."""

    def __init__(self, r: CollectorRegistry) -> None:
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
        self.interrupted = Counter(
            "rollout_turns_interrupted",
            "Worker answers that aborted a turn (a weight update, a pause), by what "
            "came of them: continued (a continuation answered), resampled (the turn "
            "sampled afresh: the engine could not continue it exactly), returned "
            "(--on-abort return) or failed (--max-continuations)",
            ["action"],
            registry=r,
        )
        self.reprefilled = Counter(
            "rollout_reprefilled_tokens",
            "Prompt tokens continuations sent that their worker did not have cached",
            registry=r,
        )
        self.sampling_conflicts = Counter(
            "rollout_sampling_conflicts",
            "Agent sampling values that differed from the session's pinned sampling, by "
            "parameter and what was done (override: the session's was sent; refuse: 400)",
            ["param", "action"],
            registry=r,
        )
        self.pause_wait = Histogram(
            "rollout_pause_wait_seconds",
            "Time an interrupted turn waited for the server to resume",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
