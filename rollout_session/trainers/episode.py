"""One agent episode through one session: the session's life, in one place.

`run_episode` creates the session (the trainer's sampling pinned on it:
whatever the agent's framework sends, the behaviour policy is the
trainer's), runs the agent against it, optionally has the teacher rescore
it, and collects the export. The session is closed whatever happens: an
agent that raises leaves no open session behind, and its episode is
dropped (`EpisodeFailed`), never trained on half-done.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from ..client import SessionClient
from .agent import Agent, AgentSession

__all__ = ["Episode", "EpisodeFailed", "run_episode"]

logger = logging.getLogger("rollout_session.trainers")


class EpisodeFailed(RuntimeError):
    """The agent raised, or returned something that is not a reward: its
    session was closed and the episode is dropped."""


@dataclass(frozen=True, slots=True)
class Episode:
    session_id: str
    # The collected export document (schema 3: every segment once).
    document: dict[str, Any]
    # The agent's reward; None leaves the scoring to the trainer.
    reward: float | None


async def run_episode(
    client: SessionClient,
    agent: Agent,
    row: Mapping[str, Any],
    *,
    sampling: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    teacher: str | None = None,
    include: Sequence[str] | None = None,
) -> Episode:
    """`agent` on `row` in a new session of `client`'s servers. `teacher`:
    a rescore label: the teacher workers score every position before the
    session is collected (``rescores[teacher]`` in the export)."""
    handle = await client.create(
        metadata=dict(metadata) if metadata is not None else None,
        sampling=dict(sampling) if sampling is not None else None,
    )
    session = AgentSession(handle.session_id, handle.base_url, handle.api_key or "unused")
    try:
        reward = _reward(await agent(session, row))
        if teacher is not None:
            await client.rescore(handle, "teacher", teacher, positions="all")
    except BaseException as failure:
        with anyio.CancelScope(shield=True):
            try:
                await client.close(handle, include=())
            except Exception as exc:  # the failure below is what matters
                logger.warning("session %s: closing it failed: %s", handle.session_id, exc)
        if isinstance(failure, Exception):
            raise EpisodeFailed(
                f"session {handle.session_id}: the agent failed ({failure!r}); "
                "the episode is dropped"
            ) from failure
        raise
    document = await client.close(handle, include=include)
    return Episode(handle.session_id, document, reward)


def _reward(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"an agent returns a finite number or None, not {value!r}")
    return float(value)
