"""The worker pool: one engine's workers, split by concern (docs/reliability.md#workers).

Owns: one worker's record and state machines (`worker`), who is in and the
pool's change signal (`membership`), health from probes and the served
model (`health`), the circuit breaker on real traffic (`circuit`), which
worker takes a session (`placement`), HTTP to one worker (`client`),
best-effort control calls and worker-side sessions (`control`), pauses in
abort mode (`interrupts`), the one path of an engine's request (`dispatch`),
what the pool needs of an engine family (`dialect`), its options
(`options`), and `WorkerPool`, which puts them together (`pool`).

May import the engines wing's shared modules (`base`, `scoring`,
`worker_urls`), `errors` and `tokens`; never an engine package (an engine
hands the pool its `dialect.WorkerDialect`), `session`, `turn` or `http`.
"""

from .client import UpstreamReply
from .dialect import ModelInfo, Probe, WorkerDialect
from .dispatch import Check, Sent, WorkerRequest
from .options import PoolOptions
from .pool import WorkerPool
from .worker import Circuit, Health, Worker

__all__ = [
    "Check",
    "Circuit",
    "Health",
    "ModelInfo",
    "PoolOptions",
    "Probe",
    "Sent",
    "UpstreamReply",
    "Worker",
    "WorkerDialect",
    "WorkerPool",
    "WorkerRequest",
]
