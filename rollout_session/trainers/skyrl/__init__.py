"""SkyRL 0.4.0: a generator that rolls out through sessions, and the weight
sync's hook (docs/trainers.md#skyrl).

``rollout_session.trainers.skyrl.SessionGenerator`` is the generator
(`generator`), configured under ``generator.rollout_session`` (`config`,
`options`), turning each episode's export into SkyRL's rows (`outputs`);
`SessionPPOExp` is SkyRL's experiment returning it and `main` its
entrypoint (`experiment`); `install_weight_sync` pauses the session servers
around SkyRL's weight sync (`weight_sync`). SkyRL itself is imported only
when one of them is used: this package imports without it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SessionGenerator",
    "SessionGeneratorConfig",
    "SessionPPOExp",
    "SessionTrainConfig",
    "install_weight_sync",
    "main",
]


def __getattr__(name: str) -> Any:
    if name == "SessionGenerator":
        from .generator import SessionGenerator

        return SessionGenerator
    if name in ("SessionGeneratorConfig", "SessionTrainConfig"):
        from . import config

        return getattr(config, name)
    if name in ("SessionPPOExp", "main"):
        from . import experiment

        return getattr(experiment, name)
    if name == "install_weight_sync":
        from .weight_sync import install_weight_sync

        return install_weight_sync
    raise AttributeError(name)
