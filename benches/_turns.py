"""The server's turn runner in a bench's own process (not a benchmark itself).

Benches that need whole turns in-process drive the real `TurnRunner.run`
(claim, parse, plan, the engine, commit, release), built as `create_app`
builds it: a `SessionStore` over a `SessionRegistry` with the engine, a
`PauseGate`, an `Offload`, `TurnMetrics`, a `ServedModel` and the settings'
`TurnPolicy`. Two engines:

- `replay_runner`: a `ReplayEngine` (replay_engine):
  no worker, completions given by the bench;
- `emulator_runner`: the ``sglang-chat`` engine with a worker pool of one
  emulator (placement, HTTP, the pool's admission of the worker), answers
  validated inline (``parse_processes=0``: no validation processes).

Steps a bench times on their own get their inputs from the same code: the
emulator runner's engine is a `Recorder`, which keeps the request the runner
handed it and the completion the turn committed.

Scripts import this as ``_turns`` (Python puts the script's directory first
on ``sys.path``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import ClassVar

import trio
from prometheus_client import CollectorRegistry
from replay_engine import ReplayEngine, ReplaySource

from rollout_session import Settings
from rollout_session.engines.base import (
    Completion,
    Engine,
    EngineCounter,
    EngineRequest,
    EngineSession,
    Refusal,
)
from rollout_session.engines.pool import WorkerPool
from rollout_session.engines.served_model import ServedModel
from rollout_session.engines.sglang_chat.engine import SGLangChatEngine
from rollout_session.engines.sglang_chat.spec import SPEC as SGLANG_CHAT
from rollout_session.prompt.tokenizer import ChatTokenizer
from rollout_session.session.session import SessionRegistry
from rollout_session.session.store import SessionStore
from rollout_session.turn.metrics import TurnMetrics
from rollout_session.turn.offload import Offload
from rollout_session.turn.pause import PauseGate
from rollout_session.turn.runner import TurnRunner
from rollout_session.turn.validator import AnswerValidator

__all__ = ["REPLAY_WORKER", "Recorder", "emulator_runner", "replay_runner", "turn_runner"]

# Settings need a worker URL; a replay runner never calls it.
REPLAY_WORKER = "http://worker"


def turn_runner(
    settings: Settings,
    store: SessionStore,
    engine: Engine,
    tokenizer: ChatTokenizer,
    model: ServedModel,
    offload: Offload,
) -> TurnRunner:
    """A runner as `create_app`'s start-up builds it (no template check: no
    roles beyond --append-roles)."""
    return TurnRunner(
        store=store,
        pause=PauseGate(settings.pause_wait_s),
        engine=engine,
        offload=offload,
        metrics=TurnMetrics(CollectorRegistry()),
        tokenizer=tokenizer,
        model=model,
        policy=settings.turn_policy(),
    )


def _offload(settings: Settings) -> Offload:
    return Offload(threshold_bytes=settings.offload_threshold_bytes, threads=settings.cpu_threads)


def _validator(settings: Settings, offload: Offload) -> AnswerValidator:
    """Checks on the loop or a thread: no validation process runs here."""
    return AnswerValidator(
        offload, processes=0, process_threshold_bytes=settings.process_threshold_bytes
    )


def replay_runner(
    source: ReplaySource, tokenizer: ChatTokenizer, settings: Settings | None = None
) -> TurnRunner:
    """A runner whose engine replays what `source` gives (no worker, no I/O).
    The model's context is ``settings.context_length`` (None: unknown)."""
    settings = settings or Settings(workers=(REPLAY_WORKER,))
    engine = ReplayEngine(source)
    store = SessionStore(SessionRegistry(max_sessions=settings.max_sessions), engine)
    offload = _offload(settings)
    # An empty pool: the model's name is unknown, its context the setting.
    pool = WorkerPool(settings.pool_options(SGLANG_CHAT.dialect), _validator(settings, offload))
    model = ServedModel(pool, settings.context_length)
    return turn_runner(settings, store, engine, tokenizer, model, offload)


@dataclass
class Recorder:
    """An engine that passes every call on to `engine` and keeps the last
    request and result (what a bench times the engine's steps on)."""

    engine: Engine
    request: EngineRequest | None = None
    result: Completion | Refusal | None = None

    can_continue: ClassVar[bool] = False  # as the sglang-chat engine it wraps here

    async def complete(
        self, session: EngineSession, request: EngineRequest
    ) -> Completion | Refusal:
        self.request = request
        self.result = await self.engine.complete(session, request)
        return self.result

    async def prepare(self, tokenizer: ChatTokenizer) -> None:
        await self.engine.prepare(tokenizer)

    def counters(self) -> Iterable[EngineCounter]:
        return self.engine.counters()

    def adopt(self, session: EngineSession) -> None:
        self.engine.adopt(session)

    async def close_worker_sessions(self, sessions: Iterable[EngineSession]) -> None:
        await self.engine.close_worker_sessions(sessions)

    def release(self, session: EngineSession) -> None:
        self.engine.release(session)

    def completion(self) -> tuple[EngineRequest, Completion]:
        """The last request and its completion (the turn committed it)."""
        if self.request is None or not isinstance(self.result, Completion):
            raise RuntimeError(f"the engine's last answer is not a completion: {self.result!r}")
        return self.request, self.result


@asynccontextmanager
async def emulator_runner(
    url: str, tokenizer: ChatTokenizer, settings: Settings | None = None
) -> AsyncIterator[TurnRunner]:
    """A runner whose engine is ``sglang-chat`` over a pool of the worker at
    `url` (running until the block ends), wrapped in a `Recorder`
    (``runner.engine``). Returns once the pool admitted the worker."""
    settings = settings or Settings(workers=(url,))
    settings = dataclasses.replace(settings, workers=(url,), parse_processes=0)
    offload = _offload(settings)
    pool = WorkerPool(settings.pool_options(SGLANG_CHAT.dialect), _validator(settings, offload))
    pool.add(url)
    model = ServedModel(pool, settings.context_length, settings.upstream_model)
    engine = Recorder(SGLangChatEngine(pool, model, session_hints=settings.sends_session_hints))
    store = SessionStore(SessionRegistry(max_sessions=settings.max_sessions), engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        try:
            await pool.model_info()
            await pool.wait_for_health(url, True)
            yield turn_runner(settings, store, engine, tokenizer, model, offload)
        finally:
            await pool.aclose()
