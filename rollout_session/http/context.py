"""The server's owned services: one `ServerContext` per app, built by `create_app`.

Nothing is global: the session store (registry and journal), the worker pool,
the tokenizer, the CPU offload, the answer validator and the turn runner live
here and are reached through the app that owns them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import Settings
from ..engines.base import Engine
from ..engines.pool import WorkerPool
from ..engines.served_model import ServedModel
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

__all__ = ["ServerContext"]


@dataclass
class ServerContext:
    settings: Settings
    # Every session life-cycle change (create, commit, expire, close, forget,
    # restore) goes through the store; lookups may read `registry`.
    store: SessionStore
    pool: WorkerPool
    engine: Engine  # what turns sample from (the pool is its workers)
    offload: Offload
    validator: AnswerValidator
    pause: PauseGate
    metrics: Metrics
    model: ServedModel
    expiry: Expiry  # the reaper
    rescorer: Rescorer
    # --teacher-worker: scoring only (rescores), never a rollout turn.
    teachers: WorkerPool | None = None
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Set during startup (before serving): loading needs the worker's answer.
    tokenizer: ChatTokenizer | None = None
    turns: TurnRunner | None = None

    @property
    def registry(self) -> SessionRegistry:
        """The store's sessions, for lookups; change them through `store`."""
        return self.store.registry

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
