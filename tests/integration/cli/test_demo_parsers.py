"""`serve --demo`'s parsers (`cli.demo`), in process: the workers are
launched with their chat template's parsers, and only under `--engine vllm`
(whose workers publish none) does the server name them too."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from rollout_session.cli.demo import demo_parsers, worker_parsers
from rollout_session.config import Settings
from rollout_session.prompt.builtin import builtin_template


def vllm(**changes: Any) -> Settings:
    return Settings(demo=True, engine="vllm", **changes)


@pytest.mark.parametrize(
    ("template", "reasoning", "expected"),
    [
        ("chatml", False, ("hermes", None)),
        # ChatML renders no reasoning: the demo answers without any.
        ("chatml", True, ("hermes", None)),
        ("qwen3", True, ("hermes", "qwen3")),
    ],
    ids=["chatml", "chatml-reasoning", "qwen3-reasoning"],
)
def test_under_vllm_the_server_is_given_the_templates_parsers(
    template: str,
    reasoning: bool,
    expected: tuple[str, str | None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = vllm(demo_reasoning=reasoning)
    with caplog.at_level(logging.INFO, logger="rollout_session"):
        chosen = demo_parsers(settings, builtin_template(template))
    assert (chosen.tool_call_parser, chosen.reasoning_parser) == expected
    assert f"--tool-call-parser {expected[0]}" in caplog.text


@pytest.mark.parametrize(
    "settings",
    [
        Settings(demo=True),
        Settings(demo=True, engine="sglang-generate"),
        Settings(demo=True, engine="sglang-chat"),
        vllm(tool_call_parser="qwen3_json"),
        vllm(reasoning_parser="qwen3", demo_reasoning=True),
    ],
    ids=["auto", "sglang-generate", "sglang-chat", "tool-call-parser-given", "reasoning-given"],
)
def test_sglang_engines_and_given_parsers_are_left_alone(settings: Settings) -> None:
    """SGLang workers publish their parsers, and the server reads them."""
    assert demo_parsers(settings, builtin_template("qwen3")) is settings


def test_an_unknown_template_gets_no_parsers_and_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = vllm()
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
        (Settings(demo=True, engine="sglang-chat"), "chatml", ("qwen25", None)),
        (
            Settings(demo=True, engine="sglang-generate", tool_call_parser="hermes"),
            "chatml",
            ("hermes", None),
        ),
        (vllm(), "chatml", ("hermes", None)),
    ],
    ids=["auto", "auto-reasoning", "auto-qwen3", "sglang-chat", "server-named", "vllm"],
)
def test_the_workers_run_their_templates_parsers(
    settings: Settings, template: str, expected: tuple[str | None, str | None]
) -> None:
    """The demo launches its workers with their template's parsers in
    their engine's names (the server's, where it names them)."""
    assert worker_parsers(settings, builtin_template(template)) == expected


def test_an_unknown_template_gets_no_worker_parsers() -> None:
    assert worker_parsers(Settings(demo=True), "{{ messages }}") == (None, None)
    assert worker_parsers(Settings(demo=True), None) == (None, None)
