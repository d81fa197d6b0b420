"""The server's owned services: one `ServerContext` per app, built by `create_app`.

Nothing is global: the session store (registry and journal), the worker pool,
the tokenizer, the CPU offload, the answer validator and the turn runner live
here and are reached through the app that owns them. What depends on the
engine (its pool, the engine, the served model, the rescorer) is built at
start-up, once the engine is chosen from what the workers say
(`engines.resolve`): `engine_side`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import Settings
from ..engines.base import Engine
from ..engines.pool import WorkerPool
from ..engines.served_model import ServedModel
from ..engines.spec import EngineSpec
from ..prompt.tokenizer import ChatTokenizer
from ..session.expiry import Expiry
from ..session.session import SessionRegistry
from ..session.store import SessionStore
from ..turn.offload import Offload
from ..turn.pause import PauseGate
from ..turn.rescore import Rescorer
from ..turn.validator import AnswerValidator

if TYPE_CHECKING:
    from ..turn.runner import TurnRunner
    from .metrics import Metrics

__all__ = ["EngineSide", "ServerContext"]


@dataclass(frozen=True)
class EngineSide:
    """The engine chosen at start-up and what it is built on."""

    spec: EngineSpec
    settings: Settings  # the server's, with --engine and its flags as resolved
    pool: WorkerPool
    engine: Engine  # what turns sample from (the pool is its workers)
    model: ServedModel
    rescorer: Rescorer
    # --teacher-worker: scoring only (rescores), never a rollout turn.
    teachers: WorkerPool | None = None


@dataclass
class ServerContext:
    settings: Settings
    # Every session life-cycle change (create, commit, expire, close, forget,
    # restore) goes through the store; lookups may read `registry`.
    store: SessionStore
    offload: Offload
    validator: AnswerValidator
    pause: PauseGate
    metrics: Metrics
    expiry: Expiry  # the reaper
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Set during startup (before serving): choosing the engine and loading
    # the tokenizer need the workers' answers.
    engine_side: EngineSide | None = None
    tokenizer: ChatTokenizer | None = None
    turns: TurnRunner | None = None

    @property
    def registry(self) -> SessionRegistry:
        """The store's sessions, for lookups; change them through `store`."""
        return self.store.registry

    @property
    def side(self) -> EngineSide:
        if self.engine_side is None:
            raise RuntimeError("the engine used before startup chose it")
        return self.engine_side

    @property
    def pool(self) -> WorkerPool:
        return self.side.pool

    @property
    def engine(self) -> Engine:
        return self.side.engine

    @property
    def model(self) -> ServedModel:
        return self.side.model

    @property
    def rescorer(self) -> Rescorer:
        return self.side.rescorer

    @property
    def teachers(self) -> WorkerPool | None:
        return self.side.teachers

    @property
    def ready_tokenizer(self) -> ChatTokenizer:
        if self.tokenizer is None:
            raise RuntimeError("tokenizer used before startup finished")
        return self.tokenizer

    @property
    def turn_runner(self) -> TurnRunner:
        if self.turns is None:
            raise RuntimeError("turn runner used before startup finished")
        return self.turns
