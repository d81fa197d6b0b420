"""Trainer adapters: a trainer rolls out through session servers and trains
on their exact trajectories (docs/trainers.md).

Owns what every adapter needs — an agent episode through one session
(`episode`), an exported segment as token arrays (`segments`), the trainer's
inference servers registered as workers (`workers`), the session servers
paused and resumed around the trainer's weight update (`weight_sync`) — and
one sub-package per trainer (`verl`, `skyrl`), which imports its trainer only when
used. Sits on the client (`rollout_session.client`): may import it and
`rollout_session.errors`, nothing of the server; the server never imports
this wing.
"""

from __future__ import annotations

from .agent import Agent, AgentSession, load_agent
from .episode import Episode, EpisodeFailed, run_episode

__all__ = ["Agent", "AgentSession", "Episode", "EpisodeFailed", "load_agent", "run_episode"]
