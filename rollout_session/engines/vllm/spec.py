"""The `vllm` engine as the registry knows it."""

from __future__ import annotations

from ..base import Engine
from ..kv_sessions import KvMode
from ..spec import EngineFlag, EngineParts, EngineSettings, EngineSpec
from .parsers import VllmParsers
from .worker import SAMPLING_DEFAULTS, VLLM_WORKERS

__all__ = ["SPEC"]


def _parsers(settings: EngineSettings) -> VllmParsers:
    """The workers' parsers (ValueError: one the translation does not reproduce)."""
    return VllmParsers(settings.tool_call_parser, settings.reasoning_parser)


def _check(settings: EngineSettings) -> None:
    _parsers(settings)
    if settings.kv_sessions != KvMode.OFF.value:
        raise ValueError(
            "kv_sessions is SGLang's (session ids in its radix cache, its sessions); "
            "--engine vllm keeps a session on one worker by placement and sends "
            "X-Session-ID for a router (docs/engines.md#what-each-engine-supports)"
        )


def _build(settings: EngineSettings, parts: EngineParts) -> Engine:
    from .engine import VllmEngine
    from .request import VllmOptions

    return VllmEngine(
        parts.pool,
        parts.model,
        VllmOptions(_parsers(settings)),
        worker_defaults=parts.launch.get(SAMPLING_DEFAULTS),
    )


SPEC = EngineSpec(
    name="vllm",
    summary="vLLM's /inference/v1/generate, its chat route's translation reproduced",
    dialect=VLLM_WORKERS,
    flags=(
        EngineFlag("--tool-call-parser", "the workers' --tool-call-parser (vLLM's name)"),
        EngineFlag("--reasoning-parser", "the workers' --reasoning-parser (vLLM's name)"),
    ),
    check=_check,
    build=_build,
    # vLLM publishes no launch settings; its chat route's sampling defaults
    # show in its own rendering of a request (`worker._sampling_defaults`).
    worker_settings={SAMPLING_DEFAULTS: None},
    auto=True,
)
