"""rollout-session: stateful token-trajectory session server for RL rollouts.

Agents talk OpenAI chat to ``/sessions/{id}/v1``; the server keeps each
session's exact token trajectory, pins its turns to one SGLang worker, and
hands the trainer a training-ready document.
"""

from .app import create_app
from .config import Settings
from .errors import RolloutSessionError
from .export import SCHEMA_VERSION
from .sessions import SessionState

__all__ = ["SCHEMA_VERSION", "RolloutSessionError", "SessionState", "Settings", "create_app"]
