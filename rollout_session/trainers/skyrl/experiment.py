"""SkyRL's experiment with `SessionGenerator`, and its entrypoint
(docs/trainers.md#skyrl).

SkyRL 0.4.0 builds an experiment's generator in ``BasePPOExp.get_generator(
cfg, tokenizer, inference_engine_client)`` (``skyrl/train/entrypoints/
main_base.py``), once the inference client (its vLLM servers) is up.
`SessionPPOExp` returns `SessionGenerator` there; an experiment of one's
own does the same in three lines:

    class MyExp(BasePPOExp):
        def get_generator(self, cfg, tokenizer, inference_engine_client):
            return SessionGenerator(cfg, tokenizer, inference_engine_client)

`main` is the entrypoint: it parses the command line with
`config.SessionTrainConfig` (``generator.rollout_session`` is not a key of
SkyRL's own config) and runs the experiment as SkyRL's ``main`` does. Run
it as ``python -m rollout_session.trainers.skyrl.experiment …`` or through
SkyRL's own entrypoint with ``trainer.override_entrypoint=
rollout_session.trainers.skyrl.experiment`` (``main_base.main`` peeks at
that key before its strict parse and calls this module's ``main()``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import ray
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.utils import initialize_ray

from .config import SessionTrainConfig
from .generator import SessionGenerator

__all__ = ["SessionPPOExp", "main"]

_OVERRIDE = "trainer.override_entrypoint="


class SessionPPOExp(BasePPOExp):  # type: ignore[misc]
    def get_generator(self, cfg: Any, tokenizer: Any, inference_engine_client: Any) -> Any:
        return SessionGenerator(cfg, tokenizer, inference_engine_client)


def config_of(argv: Sequence[str]) -> Any:
    """The typed config of a command line (SkyRL's ``trainer.override_entrypoint``
    dropped: it only chose this entrypoint, and is no config field)."""
    return SessionTrainConfig.from_cli_overrides([a for a in argv if not a.startswith(_OVERRIDE)])


@ray.remote(num_cpus=1)  # type: ignore[untyped-decorator]
def _entrypoint(cfg: Any) -> None:
    # As SkyRL's own: the training loop runs off the head node.
    SessionPPOExp(cfg).run()


def main(argv: Sequence[str] | None = None) -> None:
    cfg = config_of(sys.argv[1:] if argv is None else argv)
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(_entrypoint.remote(cfg))


if __name__ == "__main__":
    main()
