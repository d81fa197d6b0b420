"""The `sglang-chat` engine as the registry knows it."""

from __future__ import annotations

from ..base import Engine
from ..kv_sessions import DELTA_NEEDS_GENERATE, KvMode
from ..spec import EngineFlag, EngineParts, EngineSettings, EngineSpec
from .workers import SGLANG_CHAT_WORKERS

__all__ = ["SPEC"]


def _check(settings: EngineSettings) -> None:
    if settings.tool_call_parser or settings.reasoning_parser:
        raise ValueError(
            "with --engine sglang-chat the workers parse with their own "
            "--tool-call-parser/--reasoning-parser: leave this server's unset"
        )
    if settings.kv_sessions == KvMode.DELTA.value:
        raise ValueError(DELTA_NEEDS_GENERATE)


def _build(settings: EngineSettings, parts: EngineParts) -> Engine:
    from .engine import SGLangChatEngine

    return SGLangChatEngine(
        parts.pool, parts.model, session_hints=settings.kv_sessions == KvMode.HINT.value
    )


SPEC = EngineSpec(
    name="sglang-chat",
    summary="SGLang's chat route samples and parses",
    dialect=SGLANG_CHAT_WORKERS,
    flags=(
        EngineFlag(
            "--kv-sessions",
            "off or hint (the session id on each turn, /close_session at its end; "
            "workers need --enable-session-radix-cache)",
        ),
    ),
    check=_check,
    build=_build,
    # The parsers are the workers' own: read so that a fleet that parses
    # differently is refused, and a joining worker must agree.
    worker_settings={
        "tool_call_parser": None,
        "reasoning_parser": None,
        "skip_tokenizer_init": False,
    },
    # Its chat route answers only with a tokenizer (SGLang 0.5.23
    # serving_chat.py reads the tokenizer manager's tokenizer).
    needs={"skip_tokenizer_init": False},
)
