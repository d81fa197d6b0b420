"""The `vllm` engine as the registry knows it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..base import Engine
from ..kv_sessions import KvMode
from ..spec import EngineFlag, EngineParts, EngineSettings, EngineSpec
from .parsers import VllmParsers
from .worker import SAMPLING_DEFAULTS, TOOL_PARSING, TOOL_SKIP_SPECIAL_TOKENS, VLLM_WORKERS

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


def _agrees(settings: EngineSettings, launch: Mapping[str, Any]) -> None:
    """The parser flags against what the workers' rendering of a tool
    request shows (vLLM does not publish its parsers' names): whether they
    parse tool calls, and what their parsers do to skip_special_tokens."""
    parses = launch.get(TOOL_PARSING)
    name = settings.tool_call_parser
    if parses is None:
        return
    if name and not parses:
        raise ValueError(
            f"--tool-call-parser {name} was given here, but the workers parse no tool "
            "calls (their chat route refuses tools): launch vLLM with "
            f"--enable-auto-tool-choice --tool-call-parser {name}, or start without it"
        )
    if parses and not name:
        raise ValueError(
            "the workers parse tool calls (--enable-auto-tool-choice), but no "
            "--tool-call-parser was given here: vLLM does not publish the parser's "
            "name; give the workers' --tool-call-parser (vLLM's name)"
        )
    shown = launch.get(TOOL_SKIP_SPECIAL_TOKENS)
    ours = not _parsers(settings).keeps_special_tokens(tools_active=True)
    if parses and shown is not None and shown != ours:
        raise ValueError(
            f"the workers' parsers leave skip_special_tokens {shown} on a tool request, "
            f"where --tool-call-parser {name} and --reasoning-parser "
            f"{settings.reasoning_parser or 'none'} would leave it {ours}: the workers run "
            "other parsers than these flags name"
        )


def _build(settings: EngineSettings, parts: EngineParts) -> Engine:
    from .engine import VllmEngine
    from .request import VllmOptions

    return VllmEngine(
        parts.pool,
        parts.model,
        VllmOptions(_parsers(settings)),
        launch=parts.launch,
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
    # and whether (and how) it parses tool calls show in its own rendering
    # of a request (`worker._sampling_defaults`, `worker._tool_parsing`).
    worker_settings={SAMPLING_DEFAULTS: None, TOOL_PARSING: None, TOOL_SKIP_SPECIAL_TOKENS: None},
    agrees=_agrees,
    auto=True,
)
