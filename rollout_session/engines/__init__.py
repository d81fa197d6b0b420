"""Inference engines behind one seam (`base.Engine`), and their workers.

Owns: the engine seam (`base`: `Engine`, `EngineRequest`, `Completion`,
`Refusal`), one package per engine (`sglang_chat`: SGLang's chat route with
``input_ids``; `sglang_generate`: SGLang's native ``/generate``, parsed by
SGLang's parsers on the worker, with delta-sync; `vllm`: vLLM's
``/inference/v1/generate``, parsed by vLLM in the same call), how the pool
speaks to each engine's workers (`dialect`) and how each scores a token
sequence for a rescore (`scoring`), the reply parts the
token-route engines share (`chat_reply`), what every answer check shares (`answer`), the worker pool
(membership, admission, health, circuit breaker, sticky placement,
failover: `pool`, `placement`), HTTP to a
worker (`upstream`), worker URLs and the allow-list, the served model,
and the SGLang KV-session vocabulary.

May import: `prompt`, `errors`, `tokens`. Never `session`: an engine sees a
session as `base.EngineSession` (its id and worker pin); nor `turn` or
`http`: where validation runs is handed in as `base.Validation`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .base import Completion, Engine, EngineRequest, Refusal
    from .pool import PoolOptions, WorkerPool
    from .sglang_chat.engine import SGLangChatEngine
    from .sglang_generate.engine import SGLangGenerateEngine
    from .vllm.engine import VllmEngine

__all__ = [
    "Completion",
    "Engine",
    "EngineRequest",
    "PoolOptions",
    "Refusal",
    "SGLangChatEngine",
    "SGLangGenerateEngine",
    "VllmEngine",
    "WorkerPool",
]

_HOME = {
    "Completion": ".base",
    "Engine": ".base",
    "EngineRequest": ".base",
    "Refusal": ".base",
    "PoolOptions": ".pool",
    "WorkerPool": ".pool",
    "SGLangChatEngine": ".sglang_chat.engine",
    "SGLangGenerateEngine": ".sglang_generate.engine",
    "VllmEngine": ".vllm.engine",
}

__getattr__, __dir__ = lazy_attributes(__name__, _HOME, __all__)
