"""The `sglang-generate` engine as the registry knows it."""

from __future__ import annotations

from ..base import Engine
from ..kv_sessions import KvMode
from ..sglang_workers import PARSE_ROUTES, sglang_setting
from ..spec import EngineFlag, EngineParts, EngineSettings, EngineSpec, boolean
from .parsers import Parsers
from .workers import SGLANG_GENERATE_WORKERS

__all__ = ["SPEC"]


def _parsers(settings: EngineSettings) -> Parsers:
    """The workers' parsers (ValueError: one the translation does not reproduce)."""
    return Parsers(settings.tool_call_parser, settings.reasoning_parser)


def _check(settings: EngineSettings) -> None:
    _parsers(settings)


def _build(settings: EngineSettings, parts: EngineParts) -> Engine:
    from .delta import RemoteSessions
    from .engine import SGLangGenerateEngine
    from .request import GenerateOptions

    mode = KvMode(settings.kv_sessions)
    return SGLangGenerateEngine(
        parts.pool,
        parts.model,
        GenerateOptions(_parsers(settings)),
        session_hints=mode is KvMode.HINT,
        delta=RemoteSessions() if mode is KvMode.DELTA else None,
        # A worker reaps an idle session after this; a later turn rebuilds it.
        remote_timeout_s=settings.session_ttl_s,
        launch=parts.launch,
    )


SPEC = EngineSpec(
    name="sglang-generate",
    summary="SGLang's /generate, the chat route's translation reproduced",
    dialect=SGLANG_GENERATE_WORKERS,
    flags=(
        EngineFlag("--tool-call-parser", "the workers' --tool-call-parser (SGLang's name)"),
        EngineFlag("--reasoning-parser", "the workers' --reasoning-parser (SGLang's name)"),
        EngineFlag(
            "--skip-tokenizer-init",
            "true or false: the workers' --skip-tokenizer-init (they answer ids without "
            "text); read from the workers (a server started without any learns it from "
            "the first to join)",
            kind=boolean,
        ),
        EngineFlag(
            "--kv-sessions",
            "off, hint, or delta (each turn sends only new ids over SGLang sessions; "
            "docs/kv-sessions.md)",
        ),
    ),
    check=_check,
    build=_build,
    worker_settings={
        "tool_call_parser": None,
        "reasoning_parser": None,
        "skip_tokenizer_init": False,
        PARSE_ROUTES: True,
    },
    # The parse routes take the parser's name per request, so a worker
    # launched without parsers (verl launches SGLang so) is served with this
    # server's `--tool-call-parser`/`--reasoning-parser`.
    supplied=frozenset({"tool_call_parser", "reasoning_parser"}),
    canonical=sglang_setting,
    # Answers are parsed by the worker's /separate_reasoning and
    # /parse_function_call; a gateway that does not route them (smg) gets
    # `auto`'s fallback, the chat route.
    needs={PARSE_ROUTES: True},
    auto=True,
    # Parsers this engine does not reproduce (gpt-oss's) still parse exactly
    # on the chat route, which needs a tokenizer (its `needs`).
    fallback="sglang-chat",
)
