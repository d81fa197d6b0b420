"""The registry: every engine by name, their flags merged for the CLI, and
the refusal of a flag the chosen engine does not take."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from rollout_session.engines import registry
from rollout_session.engines.registry import (
    AUTO,
    DEFAULT_ENGINE,
    ENGINES,
    engine_flags,
    engine_names,
    engine_spec,
    refuse_unserved,
)


@dataclass(frozen=True)
class Flags:
    """The settings an engine reads (`spec.EngineSettings`)."""

    engine: str = "sglang-chat"
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    skip_tokenizer_init: bool | None = None
    kv_sessions: str = "off"
    session_ttl_s: float | None = 3600.0


DEFAULTS = Flags()


def default(field: str) -> object:
    return getattr(DEFAULTS, field)


def test_every_engine_is_there_by_its_name() -> None:
    assert list(ENGINES) == ["sglang-chat", "sglang-generate", "vllm"]
    assert all(engine_spec(name).name == name for name in ENGINES)
    assert DEFAULT_ENGINE == AUTO and engine_names() == (AUTO, *ENGINES)
    with pytest.raises(ValueError, match="one of auto, sglang-chat, sglang-generate, vllm"):
        engine_spec("tgi")


def test_auto_is_checked_once_the_workers_chose_the_engine() -> None:
    refuse_unserved(Flags(engine=AUTO, tool_call_parser="anything", kv_sessions="delta"), default)


def test_a_flag_several_engines_take_says_what_it_means_for_each() -> None:
    flags = engine_flags()
    assert set(flags) == {
        "tool_call_parser",
        "reasoning_parser",
        "skip_tokenizer_init",
        "kv_sessions",
    }
    flag, help_text = flags["tool_call_parser"]
    assert flag.flag == "--tool-call-parser"
    assert "sglang-generate: the workers' --tool-call-parser (SGLang's name)" in help_text
    assert "vllm: the workers' --tool-call-parser (vLLM's name)" in help_text
    assert "sglang-chat" not in help_text
    _, kv_help = flags["kv_sessions"]
    assert (
        kv_help.startswith("sglang-chat: off or hint") and "sglang-generate: off, hint" in kv_help
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (Flags(engine="vllm", kv_sessions="hint"), "kv_sessions is SGLang's"),
        (Flags(kv_sessions="delta"), "needs --engine sglang-generate"),
        (Flags(tool_call_parser="qwen25"), "the workers parse with their own"),
        (Flags(engine="sglang-generate", reasoning_parser="nope"), "not reproduced"),
        (Flags(engine="vllm", tool_call_parser="mistral"), "does not support --tool-call-parser"),
    ],
    ids=["vllm-kv", "chat-delta", "chat-parser", "generate-parser", "vllm-parser"],
)
def test_an_engine_refuses_what_it_cannot_serve_with_its_reason(
    settings: Flags, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        refuse_unserved(settings, default)


@pytest.mark.parametrize(
    "settings",
    [
        Flags(),
        Flags(kv_sessions="hint"),
        Flags(engine="sglang-generate", tool_call_parser="qwen25", kv_sessions="delta"),
        Flags(engine="vllm", tool_call_parser="hermes", reasoning_parser="qwen3"),
    ],
    ids=["chat", "chat-hint", "generate-delta", "vllm-parsers"],
)
def test_what_an_engine_takes_passes(settings: Flags) -> None:
    refuse_unserved(settings, default)


def test_a_flag_the_engine_neither_takes_nor_explains_is_refused_naming_its_takers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine with no flags and a check that explains nothing (as a new
    engine might be) is still never handed another engine's flag."""
    quiet = dataclasses.replace(
        ENGINES["vllm"], name="quiet", flags=(), check=lambda settings: None
    )
    monkeypatch.setattr(registry, "ENGINES", {**ENGINES, "quiet": quiet})
    refuse_unserved(Flags(engine="quiet"), default)
    with pytest.raises(
        ValueError, match="--kv-sessions is for --engine sglang-chat, sglang-generate, not quiet"
    ):
        refuse_unserved(Flags(engine="quiet", kv_sessions="hint"), default)
