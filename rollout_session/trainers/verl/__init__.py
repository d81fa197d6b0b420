"""verl 0.9.1: an agent loop that rolls out through sessions, and the weight
update's hook (docs/trainers.md#verl).

``rollout_session.trainers.verl.SessionAgentLoop`` is the agent loop
(`loop`), built from the export (`outputs`), on the servers verl launched
(`servers`); `install_weight_sync` pauses the session servers around verl's
weight update (`weight_sync`). verl itself is imported only when one of
them is used: this package imports without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SessionAgentLoop", "install_weight_sync"]


def __getattr__(name: str) -> Any:
    if name == "SessionAgentLoop":
        from .loop import SessionAgentLoop

        return SessionAgentLoop
    if name == "install_weight_sync":
        from .weight_sync import install_weight_sync

        return install_weight_sync
    raise AttributeError(name)
