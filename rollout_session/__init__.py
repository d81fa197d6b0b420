"""rollout-session: stateful token-trajectory session server for RL rollouts.

Agents talk to ``/sessions/{id}/v1`` as to a model API (OpenAI chat
completions, Responses, Anthropic Messages); the server keeps each
session's exact token trajectory, sends every turn of a session to the same
SGLang or vLLM worker, and hands the trainer a training-ready document.

The public names are imported on first use: validation worker processes
import an engine's ``answer`` module only, and must not pay for the web stack
(Quart, transformers: ~0.9 s and ~100 MB per process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes

if TYPE_CHECKING:
    from .config import Settings
    from .errors import RolloutSessionError
    from .export.document import SCHEMA_VERSION
    from .http.app import create_app
    from .session.session import SessionState

__all__ = ["SCHEMA_VERSION", "RolloutSessionError", "SessionState", "Settings", "create_app"]

_HOME = {
    "SCHEMA_VERSION": ".export.document",
    "RolloutSessionError": ".errors",
    "SessionState": ".session.session",
    "Settings": ".config",
    "create_app": ".http.app",
}

__getattr__, __dir__ = lazy_attributes(__name__, _HOME, __all__)
