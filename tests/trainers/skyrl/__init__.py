"""SkyRL 0.4.0 against `rollout_session.trainers.skyrl` (scripts/test-skyrl)."""

from __future__ import annotations

import os

import pytest

__all__ = ["require_skyrl"]


def require_skyrl() -> None:
    """Skip the calling module, saying why, when skyrl cannot be imported;
    fail instead under ROLLOUT_SESSION_REQUIRE_TRAINERS=1 (scripts/test-skyrl:
    its venv has skyrl, so a missing one is a broken build, not a skip)."""
    try:
        import skyrl.train.generators.base  # noqa: F401
    except ImportError as exc:
        reason = (
            f"skyrl 0.4.0 is not importable here ({type(exc).__name__}: {exc}); the SkyRL "
            "suite runs in its own venv: scripts/test-skyrl"
        )
        if os.environ.get("ROLLOUT_SESSION_REQUIRE_TRAINERS") == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason, allow_module_level=True)
