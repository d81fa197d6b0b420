"""How the pool speaks to one kind of worker: the contract between the pool
and an engine family.

The pool's bookkeeping (health, circuits, pins) is the same for every
engine; only these exchanges differ. An engine package declares its
`WorkerDialect` (``sglang_workers.sglang_dialect`` for both SGLang engines,
``vllm.worker.VLLM_WORKERS``) and the registry hands it to the pool.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..scoring import ScoringDialect
from .client import UpstreamReply, WorkerClient

__all__ = ["ANY_VOCAB", "PROBE_SESSION", "ModelInfo", "Probe", "WorkerDialect"]

# The session id (routing key) of the pool's own probes: never an agent's.
PROBE_SESSION = "rollout-session-probe"

# A probe's answer is checked like a turn's, but the pool does not know the
# vocabulary: any non-negative id passes.
ANY_VOCAB = 2**31 - 1


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What a worker serves, as its admission check read it."""

    model: str
    tokenizer_path: str | None
    max_model_len: int | None
    # Every model id the worker's /v1/models lists (`model` is the first).
    models: tuple[str, ...] = ()
    # The launch settings an engine depends on, as the worker publishes
    # them, by this server's field names (SGLang's /server_info:
    # tool_call_parser, reasoning_parser, skip_tokenizer_init); a key is
    # absent where the worker does not say. Every worker of a pool must
    # agree on each (`health.HealthChecks`).
    settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class Probe:
    """The one-token request that proves a worker samples and answers in its
    engine's shape (a circuit's confirming and half-open probes): its path,
    its body for the served model, and the check of its 200 answer
    (`UpstreamMalformed` when it fails)."""

    path: str
    body: Callable[[str], bytes]
    check: Callable[[bytes], object]


@dataclass(frozen=True, slots=True)
class WorkerDialect:
    name: str  # the engine family, as log lines and errors name it ("SGLang", "vLLM")
    # What a worker serves, within a deadline; `UpstreamError` (with the
    # reason) when it is not this engine's worker or lists no model.
    read_model: Callable[[WorkerClient, float], Awaitable[ModelInfo]]
    probe: Probe
    # Headers whose value is the session id on every request: a router in
    # front of the workers keeps a session on one worker by them.
    session_headers: tuple[bytes, ...]
    # The requests (path, body) that abort these in-flight requests, by the
    # id the engine sent: each then answers `abort` with what it had
    # sampled (a pause in abort mode).
    abort_requests: Callable[[list[str]], list[tuple[str, bytes]]]
    # How a worker scores a token sequence without sampling (a rescore).
    scoring: ScoringDialect
    # A refusal because the worker is paused by someone else (vLLM's 503
    # "Generation is paused"): sent again once it resumes (`pool.paused`);
    # None where a paused worker holds requests instead (SGLang).
    paused: Callable[[UpstreamReply], bool] | None = None
    # Where the worker says whether it is paused, and how to read the
    # answer (vLLM's GET /is_paused → `is_paused`); with `paused`.
    pause_status: tuple[str, Callable[[Mapping[str, Any]], object]] | None = None
    # How a launch setting that is no flag of the worker's reads in a
    # refusal ("runs <text>"), by `ModelInfo.settings` name; a flag's name
    # is written as the flag (`health.flag_text`).
    settings_text: Mapping[str, Callable[[Any], str]] = field(
        default_factory=lambda: MappingProxyType({})
    )
