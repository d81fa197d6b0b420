"""Inference engines behind one seam (`base.Engine`), and their workers.

Owns: the engine seam (`base`: `Engine`, `EngineRequest`, `Completion`,
`Refusal`), what an engine package declares (`spec.EngineSpec`) and the
registry that names every engine (`registry`), one package per engine
(`sglang_chat`: SGLang's chat route with ``input_ids``; `sglang_generate`:
SGLang's native ``/generate``, parsed by SGLang's parsers on the worker,
with delta-sync; `vllm`: vLLM's ``/inference/v1/generate``, parsed by vLLM
in the same call), and what engines share: the answer checks' pieces
(`answer`), continuations stitched onto what was sampled (`stitch`), the
token routes' reply pieces (`chat_reply`), scoring a token sequence for a
rescore (`scoring`), what both SGLang engines know of an SGLang worker
(`sglang_workers`), the worker pool (`pool/`: membership, health, circuit,
placement, the worker client, interrupts, dispatch), worker URLs and the
allow-list, the served model, and the SGLang KV-session vocabulary.

May import: `prompt`, `errors`, `tokens`. Never `session`: an engine sees a
session as `base.EngineSession` (its id and worker pin); nor `turn` or
`http`: where validation runs is handed in as `base.Validation`. Inside:
`registry` over the engine packages, which import what engines share and
never each other; the pool imports no engine (import-linter checks both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .base import Completion, Engine, EngineRequest, Refusal
    from .pool import PoolOptions, WorkerPool
    from .registry import ENGINES
    from .sglang_chat.engine import SGLangChatEngine
    from .sglang_generate.engine import SGLangGenerateEngine
    from .vllm.engine import VllmEngine

__all__ = [
    "ENGINES",
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
    "ENGINES": ".registry",
    "PoolOptions": ".pool",
    "WorkerPool": ".pool",
    "SGLangChatEngine": ".sglang_chat.engine",
    "SGLangGenerateEngine": ".sglang_generate.engine",
    "VllmEngine": ".vllm.engine",
}

__getattr__, __dir__ = lazy_attributes(__name__, _HOME, __all__)
