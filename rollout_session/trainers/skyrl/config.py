"""The generator's options in SkyRL's config: ``generator.rollout_session``.

SkyRL 0.4.0 refuses a key its config dataclasses do not declare (the ``+``
prefix included: "To add custom config fields, subclass the relevant
config dataclass", ``skyrl/train/config/config.py``
``SkyRLTrainConfig.from_cli_overrides``); ``make_config(generator_cls=...)``
builds the root config around a subclassed ``GeneratorConfig``. So
`SessionGeneratorConfig` adds ``rollout_session`` to SkyRL's generator
section and `SessionTrainConfig` is the root config that parses it:

    generator.rollout_session.servers='["http://127.0.0.1:8000"]'
    generator.rollout_session.agent=my_pkg.agents:solve

No ``from __future__ import annotations`` here: SkyRL builds nested config
sections from the fields' types (``build_nested_dataclass``), which must be
classes, not strings.
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional  # noqa: UP035 (SkyRL's own style; any works)

from skyrl.train.config import BaseConfig, GeneratorConfig, make_config

__all__ = ["RolloutSessionConfig", "SessionGeneratorConfig", "SessionTrainConfig"]


@dataclass
class RolloutSessionConfig(BaseConfig):  # type: ignore[misc]
    """``generator.rollout_session`` (docs/trainers.md#skyrl)."""

    servers: List[str] = field(default_factory=list)  # noqa: UP006
    """The session servers' URLs."""
    agent: str = ""
    """The agent: ``package.module:function`` (``async def solve(session, row)``)."""
    workers: Any = "skyrl"
    """``skyrl``: register the inference client's ``server_urls`` with the
    session servers; a list of URLs; null: the session servers have theirs."""
    api_key: Optional[str] = None  # noqa: UP045
    """The session servers' trainer key (their ``--api-key``), if any."""
    admin_api_key: Optional[str] = None  # noqa: UP045
    """Their operator key (``--admin-api-key``: workers, pause, resume), if any."""
    max_concurrency: int = 256
    """Episodes at once per ``generate()`` call."""
    weight_sync: Optional[str] = "abort"  # noqa: UP045
    """How SkyRL's weight sync pauses the session servers: ``abort``, ``drain``
    or null (not at all)."""
    on_error: str = "mask"
    """An episode that cannot be trained on exactly (the agent raised,
    returned no reward, sampled nothing, or rewrote its history in
    trajectory rows): ``mask`` (a row that trains nothing, logged and
    counted) or ``raise`` (the batch fails)."""
    experts_top_k: Optional[int] = None  # noqa: UP045
    """Routed experts per token with R3, when the model's config has no
    ``num_experts_per_tok``."""


@dataclass
class SessionGeneratorConfig(GeneratorConfig):  # type: ignore[misc]
    """SkyRL's ``generator`` section with ``rollout_session``."""

    rollout_session: RolloutSessionConfig = field(default_factory=RolloutSessionConfig)


SessionTrainConfig: Any = make_config(generator_cls=SessionGeneratorConfig)
