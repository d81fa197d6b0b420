"""The user's agent, as every adapter calls it.

An agent is an async function ``solve(session, row) -> float | None``: it
runs any harness (an SDK, a framework, a CLI) against ``session.base_url``
with ``session.api_key``, for the dataset row `row`, and returns the
episode's reward, or None to leave the scoring to the trainer. One agent
function serves every trainer.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Agent", "AgentSession", "load_agent"]


@dataclass(frozen=True, slots=True)
class AgentSession:
    """What an agent needs of its session."""

    session_id: str
    # The OpenAI-compatible base URL of the session (…/sessions/{id}/v1).
    base_url: str
    # Its key: the session's own on a server with --api-key, else any
    # non-empty string (the SDKs refuse an empty one).
    api_key: str
    # The model name to send: the served model answers to any name.
    model: str = "policy"


Agent = Callable[[AgentSession, Mapping[str, Any]], Awaitable[float | None]]


def load_agent(spec: str | Agent) -> Agent:
    """The agent `spec` names: ``"package.module:function"``, or the function."""
    if not isinstance(spec, str):
        return spec
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"agent must be 'package.module:function', not {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"agent {spec!r}: cannot import {module_name!r} ({exc})") from exc
    for part in name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"agent {spec!r}: {module_name!r} has no {name!r}")
    if not callable(target):
        raise TypeError(f"agent {spec!r} is not a function")
    agent: Agent = target
    return agent
