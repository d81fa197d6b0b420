"""What the pool's unit tests build its parts from: options, a dialect that
speaks to `origin.Origin`, a session, and checks run inline."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from rollout_session.engines.pool import ModelInfo, PoolOptions, Probe, WorkerDialect
from rollout_session.engines.pool.client import WorkerClient
from rollout_session.engines.scoring import SGLANG_SCORING
from rollout_session.errors import UpstreamError, UpstreamMalformed
from tests.unit.engines.pool.origin import ANSWER

__all__ = ["CARD", "DIALECT", "Inline", "Session", "check_ok", "options"]

A = TypeVar("A")
R = TypeVar("R")

CARD = ModelInfo(model="m", tokenizer_path=None, max_model_len=None, models=("m",))


async def _read_model(client: WorkerClient, deadline_s: float) -> ModelInfo:
    """The card of a worker whose URL does not end in /other (which serves "o")."""
    if client.base_url.endswith("/refuse"):
        raise UpstreamError("not this engine's worker")
    if client.base_url.endswith("/other"):
        return ModelInfo(model="o", tokenizer_path=None, max_model_len=None, models=("o",))
    return CARD


def check_ok(body: bytes, arg: object = None) -> bytes:
    """A 200's check: the origin's plain answer passes, anything else is malformed."""
    if body != ANSWER:
        raise UpstreamMalformed("not the plain answer", kind="schema")
    return body


DIALECT = WorkerDialect(
    name="Test",
    read_model=_read_model,
    probe=Probe("/probe", lambda model: orjson.dumps({"model": model}), check_ok),
    session_headers=(b"x-smg-routing-key",),
    abort_requests=lambda ids: [("/abort", orjson.dumps({"ids": ids}))],
    scoring=SGLANG_SCORING,
)


def options(**changes: Any) -> PoolOptions:
    """The pool's options with the flags' defaults, then `changes`."""
    base = PoolOptions(
        dialect=DIALECT,
        placement="sticky-least-loaded",
        allowed_worker_hosts=None,
        health_interval_s=5.0,
        health_timeout_s=2.0,
        unhealthy_after=3,
        healthy_after=2,
        circuit_failures=3,
        circuit_successes=2,
        circuit_open_s=30.0,
        circuit_sessions=3,
        upstream_max_connections=4,
        upstream_timeout_s=10.0,
        connect_timeout_s=2.0,
        max_answer_bytes=1 << 20,
        sends_session_hints=False,
        fixed_upstream_model=None,
    )
    return dataclasses.replace(base, **changes)


@dataclass
class Session:
    """What an engine sees of a session."""

    id: str
    worker: str | None = None


class Inline:
    """A `Validation` that runs every check on the loop, and counts them."""

    def __init__(self) -> None:
        self.checks = 0

    async def validate(self, check: Callable[[bytes, A], R], body: bytes, arg: A, cost: int) -> R:
        self.checks += 1
        return check(body, arg)
