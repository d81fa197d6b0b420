"""The server's owned state: one `ServerContext` per app, built by `create_app`.

Nothing is global: the registry, the worker pool, the tokenizer and the CPU
limiter live here and are reached through the app that owns them.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import trio

from .config import Settings
from .lifecycle import PauseGate
from .sessions import Session, SessionRegistry
from .tokenization import ChatTokenizer
from .upstream import ModelInfo
from .workers import WorkerPool

if TYPE_CHECKING:
    from .journal import Journal
    from .metrics import Metrics

__all__ = ["ServerContext"]

T = TypeVar("T")


@dataclass
class ServerContext:
    settings: Settings
    registry: SessionRegistry
    pool: WorkerPool
    cpu_limiter: trio.CapacityLimiter
    pause: PauseGate
    metrics: Metrics
    journal: Journal | None = None
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Set during startup (before serving): loading needs the worker's answer.
    tokenizer: ChatTokenizer | None = None
    model_info: ModelInfo | None = None

    def forget(self, session: Session) -> None:
        """A session leaves the server (collected, or its keep-closed window
        passed): drop it, unpin it (idempotent) and journal that it is gone."""
        self.registry.remove(session)
        self.pool.release_session(session)
        if self.journal is not None:
            self.journal.close(session.id)

    @property
    def ready_tokenizer(self) -> ChatTokenizer:
        if self.tokenizer is None:
            raise RuntimeError("tokenizer used before startup finished")
        return self.tokenizer

    @property
    def context_length(self) -> int | None:
        if self.settings.context_length is not None:
            return self.settings.context_length
        return self.model_info.max_model_len if self.model_info else None

    async def offload(self, nbytes: int, fn: Callable[..., T], *args: object, **kw: object) -> T:
        """Run CPU-bound `fn` on a worker thread when its input is large.

        Small inputs run inline: the thread hop costs more than it saves. The
        limiter bounds threads; orjson/msgspec hold the GIL, so this keeps the
        loop responsive (health checks, other sessions) rather than adding
        throughput.
        """
        call = functools.partial(fn, *args, **kw)
        if nbytes <= self.settings.offload_threshold_bytes:
            return call()
        return await trio.to_thread.run_sync(call, limiter=self.cpu_limiter)
