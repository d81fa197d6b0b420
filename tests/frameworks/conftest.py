"""The real-framework suite (`scripts/test-frameworks`): each released agent
framework, run against `rollout-session serve --demo`, and the check that
every model call's sampled tokens are in the export (harness.py).

Not part of the default run (pyproject's `testpaths`): it needs the
`frameworks` extra.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.frameworks import harness
from tests.frameworks.harness import Episode

# Set before any framework is imported (they read them at import time):
# mini-swe-agent writes a config directory and prints a banner, LiteLLM would
# fetch its model cost map from the network.
_CONFIG_DIR = tempfile.mkdtemp(prefix="rollout-frameworks-mswea-")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", _CONFIG_DIR)
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# A failed call fails the test at once (mini-swe-agent retries 10 times,
# waiting up to a minute between tries, by default).
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
# No telemetry or tracing export from any framework.
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_EPISODES: list[Episode] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--frameworks-dump",
        type=Path,
        default=None,
        help="write each episode's model calls and export to this directory",
    )


# Warnings the frameworks' own releases raise (a pydantic schema warning in
# one LiteLLM release, deprecations in another) are theirs, and vary with
# every release the lower-bound pins let in: this suite checks tokens, so
# only these categories are relaxed, and only for it (the default run never
# loads this conftest). Unclosed resources stay errors.
_THEIR_WARNINGS = (
    "DeprecationWarning",
    "PendingDeprecationWarning",
    "FutureWarning",
    "UserWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for category in _THEIR_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore::{category}")
    directory = config.getoption("--frameworks-dump")
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        harness.DUMP_DIR[:] = [directory]


@pytest.fixture
def episodes() -> Iterator[list[Episode]]:
    """Where a test puts what each episode did; printed after the run."""
    mine: list[Episode] = []
    yield mine
    _EPISODES.extend(mine)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _EPISODES:
        terminalreporter.section("model calls vs exported segments")
        for episode in _EPISODES:
            terminalreporter.write_line(episode.line())
    if harness.PARITY:
        terminalreporter.section("the same across engines")
        for line in harness.PARITY:
            terminalreporter.write_line(line)
