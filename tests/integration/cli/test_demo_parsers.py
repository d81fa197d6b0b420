"""`serve --demo` under `--engine sglang-generate` and `--engine vllm`: the
parsers it names for its chat template (`cli.demo.demo_parsers`), in process."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from rollout_session.cli.demo import demo_parsers, worker_parsers
from rollout_session.config import Settings
from rollout_session.prompt.builtin import builtin_template


def generate(**changes: Any) -> Settings:
    return Settings(demo=True, engine="sglang-generate", **changes)


@pytest.mark.parametrize(
    ("engine", "template", "reasoning", "expected"),
    [
        ("sglang-generate", "chatml", False, ("qwen25", None)),
        # ChatML renders no reasoning: the demo answers without any.
        ("sglang-generate", "chatml", True, ("qwen25", None)),
        ("sglang-generate", "qwen3", False, ("qwen25", None)),
        ("sglang-generate", "qwen3", True, ("qwen25", "qwen3")),
        ("vllm", "chatml", False, ("hermes", None)),
        ("vllm", "qwen3", True, ("hermes", "qwen3")),
    ],
    ids=[
        "chatml",
        "chatml-reasoning",
        "qwen3",
        "qwen3-reasoning",
        "vllm-chatml",
        "vllm-qwen3-reasoning",
    ],
)
def test_the_demo_names_its_templates_parsers(
    engine: str,
    template: str,
    reasoning: bool,
    expected: tuple[str, str | None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = Settings(demo=True, engine=engine, demo_reasoning=reasoning)
    with caplog.at_level(logging.INFO, logger="rollout_session"):
        chosen = demo_parsers(settings, builtin_template(template))
    assert (chosen.tool_call_parser, chosen.reasoning_parser) == expected
    assert f"--tool-call-parser {expected[0]}" in caplog.text


@pytest.mark.parametrize(
    "settings",
    [
        Settings(demo=True),
        generate(tool_call_parser="qwen25"),
        generate(reasoning_parser="qwen3", demo_reasoning=True),
    ],
    ids=["sglang-chat", "tool-call-parser-given", "reasoning-parser-given"],
)
def test_given_parsers_and_sglang_chat_are_left_alone(settings: Settings) -> None:
    assert demo_parsers(settings, builtin_template("qwen3")) is settings


def test_an_unknown_template_gets_no_parsers_and_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = generate()
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        assert demo_parsers(settings, "{{ messages }}") is settings
        assert demo_parsers(settings, None) is settings
    assert caplog.text.count("no parsers known for this chat template") == 2


@pytest.mark.parametrize(
    ("settings", "template", "expected"),
    [
        (Settings(demo=True), "chatml", ("qwen25", None)),
        (Settings(demo=True, demo_reasoning=True), "qwen3", ("qwen25", "qwen3")),
        (Settings(demo=True), "qwen3", ("qwen25", None)),
        (generate(tool_call_parser="hermes"), "chatml", ("hermes", None)),
        (Settings(demo=True, engine="vllm"), "chatml", (None, None)),
    ],
    ids=["sglang-chat", "sglang-chat-reasoning", "sglang-chat-qwen3", "generate-named", "vllm"],
)
def test_the_workers_run_their_templates_parsers(
    settings: Settings, template: str, expected: tuple[str | None, str | None]
) -> None:
    """SGLang's chat route parses only with the worker's own parsers: the
    demo launches its workers with those of their template (the server's,
    when its engine names them)."""
    assert worker_parsers(settings, builtin_template(template)) == expected


def test_an_unknown_template_gets_no_worker_parsers() -> None:
    assert worker_parsers(Settings(demo=True), "{{ messages }}") == (None, None)
    assert worker_parsers(Settings(demo=True), None) == (None, None)
