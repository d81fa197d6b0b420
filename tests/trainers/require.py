"""The trainers' suites import their released trainer: skipped in the
default suite (which has none), a failure under scripts/test-trainers
(``ROLLOUT_SESSION_REQUIRE_TRAINERS=1``), where a missing trainer means a
broken venv, not a test to skip."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

__all__ = ["require"]


def require(module: str, why: str) -> ModuleType:
    if os.environ.get("ROLLOUT_SESSION_REQUIRE_TRAINERS") == "1":
        return importlib.import_module(module)
    imported: ModuleType = pytest.importorskip(module, reason=f"{module} is not installed: {why}")
    return imported
