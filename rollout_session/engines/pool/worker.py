"""One worker's record: its two state machines (`Health`, `Circuit`), its
load and its counters. The pool's parts change it, synchronously, on the
event loop; this module only says what each field means."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import trio

from .client import WorkerClient

__all__ = ["Circuit", "Health", "Worker"]


class Health(enum.Enum):
    """From probes (`health.HealthChecks`)."""

    # Added, never admitted: no pins until one admission check passes.
    JOINING = "joining"
    # Admitted, and its /health probes pass.
    HEALTHY = "healthy"
    # `unhealthy_after` /health probes failed in a row: no pins until
    # `healthy_after` admission checks in a row pass.
    UNHEALTHY = "unhealthy"


class Circuit(enum.Enum):
    """From real traffic (`circuit.Breaker`)."""

    # Requests flow; `circuit_failures` failed turns in a row open it.
    CLOSED = "closed"
    # No pins; half-open after `circuit_open_s`.
    OPEN = "open"
    # No pins; probes test the worker: `circuit_successes` in a row close
    # it, one failure reopens it.
    HALF_OPEN = "half_open"


@dataclass(eq=False)
class Worker:
    url: str
    client: WorkerClient  # its keep-alive connections (`client.WorkerClient`)
    health: Health = Health.JOINING
    circuit: Circuit = Circuit.CLOSED
    # Draining: no new pins; removed once `inflight` reaches 0.
    draining: bool = False
    active_sessions: int = 0  # sessions pinned here
    inflight: int = 0
    # Requests in flight here, by the id they were sent with: what a pause
    # in abort mode aborts (`interrupts.Interrupts`).
    requests: set[str] = field(default_factory=set)
    # Probes (health and admission checks) in a row.
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # Failed turns in a row while closed; probes passed while half-open.
    circuit_failures: int = 0
    # The sessions those failed turns came from: failures spread over
    # several take the worker out even when its probe passes (a sick
    # worker); one session's never do (its requests' fault).
    failing_sessions: set[str] = field(default_factory=set)
    circuit_successes: int = 0
    circuit_opened_at: float = 0.0  # trio.current_time()
    # A probe request is in flight: testing a half-open circuit, or
    # confirming that failed turns are the worker's before the circuit opens.
    probing: bool = False
    # Times answered failures reached `circuit_failures` but the probe
    # passed: the requests' fault, not the worker's (circuit stays closed).
    circuit_excused: int = 0
    # Requests it refused because someone else paused it: waited out and
    # sent again (`paused.Pauses`), never counted as failures.
    paused_refusals: int = 0
    # The served model, once an admission check saw it listed.
    model: str | None = None
    # --kv-sessions hint: whether its /server_info says it honours session
    # ids (--enable-session-radix-cache); None = not asked (yet).
    session_hints: bool | None = None
    # Why the last probe or turn failed (operators only: it names the worker).
    last_error: str | None = None
    last_checked_at: float | None = None
    # Failed best-effort calls (POST /close_session, aborts), by call.
    # Logged at the first only, however often it fails (a gateway without
    # the route fails every one).
    control_failures: Counter[str] = field(default_factory=Counter)
    # Set and replaced each time `inflight` drops to 0 (a drain waits on it).
    idle: trio.Event = field(default_factory=trio.Event)
    # Set once a drain removed it (None: no drain begun).
    removed: trio.Event | None = None

    @property
    def healthy(self) -> bool:
        """It may take pins (unless draining)."""
        return self.health is Health.HEALTHY and self.circuit is Circuit.CLOSED

    @property
    def eligible(self) -> bool:
        """It may take a new pin now."""
        return self.healthy and not self.draining

    def started(self, request_id: str | None) -> None:
        """A request to it is on its way."""
        self.inflight += 1
        if request_id is not None:
            self.requests.add(request_id)

    def finished(self, request_id: str | None) -> None:
        """A request `started` is done, however it ended."""
        self.inflight -= 1
        if request_id is not None:
            self.requests.discard(request_id)
        if self.inflight == 0:
            self.idle.set()
            self.idle = trio.Event()

    def summary(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "state": self.health.value,
            "circuit": self.circuit.value,
            "draining": self.draining,
            "model": self.model,
            "session_hints": self.session_hints,
            "active_sessions": self.active_sessions,
            "inflight": self.inflight,
            "consecutive_failures": self.consecutive_failures,
            "circuit_failures": self.circuit_failures,
            "circuit_excused": self.circuit_excused,
            "paused_refusals": self.paused_refusals,
            "last_error": self.last_error,
            "last_checked_at": self.last_checked_at,
            "control_failures": dict(self.control_failures),
        }
