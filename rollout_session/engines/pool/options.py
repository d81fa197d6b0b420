"""`PoolOptions`: what a pool follows, fixed for the app."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..worker_urls import WorkerHosts
from .dialect import WorkerDialect

__all__ = ["PoolOptions"]


@dataclass(frozen=True, kw_only=True)
class PoolOptions:
    """Built by `Settings.pool_options`, where the defaults are; each field
    is the flag of the same name (docs/reliability.md#workers)."""

    dialect: WorkerDialect  # how the pool speaks to its engine's workers
    placement: str
    allowed_worker_hosts: WorkerHosts | None  # None = any host
    health_interval_s: float
    health_timeout_s: float
    unhealthy_after: int
    healthy_after: int
    circuit_failures: int
    circuit_successes: int
    circuit_open_s: float
    # Failed turns of this many sessions in a row open the circuit though
    # its probe passes (`circuit.Breaker`).
    circuit_sessions: int
    upstream_max_connections: int
    upstream_timeout_s: float
    connect_timeout_s: float
    max_answer_bytes: int
    sends_session_hints: bool  # --kv-sessions hint
    fixed_upstream_model: str | None  # --upstream-model NAME (not a keyword)
    # What the pool's log lines call it ("" for the rollout workers).
    label: str = ""
    # Launch settings every worker must run with, where it publishes them
    # (`ModelInfo.settings`): the engine's needs and the flags the server
    # was given (a worker that says otherwise is not admitted).
    expected_settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # How long a request waits for a worker paused by someone else
    # (`paused.Pauses`; the server's --pause-wait-s).
    worker_pause_wait_s: float = 30.0
    # Those of them a worker may run without (`EngineSpec.supplied`).
    supplied_settings: frozenset[str] = frozenset()
    # Why a worker publishing these launch settings cannot be served (None:
    # it can), for a pool that learns the settings start-up could not read
    # from its first admitted worker (`engines.resolve.Resolved.admissible`).
    admissible: Callable[[Mapping[str, Any]], str | None] | None = None

    @property
    def read_model_s(self) -> float:
        """An admission check's budget for reading the model: two small
        GETs, a probe's budget each, plus connecting (its launch settings,
        a third, get the same again)."""
        return self.connect_timeout_s + 2 * self.health_timeout_s

    @property
    def retry_after_s(self) -> int:
        """When a request refused for want of a worker may try again: the
        next health round."""
        return max(1, math.ceil(self.health_interval_s))
