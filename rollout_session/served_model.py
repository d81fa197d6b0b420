"""What the workers serve: the model's name and context length."""

from __future__ import annotations

from dataclasses import dataclass

from .upstream import ModelInfo
from .workers import WorkerPool

__all__ = ["ServedModel"]


@dataclass(frozen=True)
class ServedModel:
    """A view of the pool's served model (learned by its admission checks:
    the first worker to pass names it, every other must list it), with
    ``--context-length`` winning over what the worker reports."""

    pool: WorkerPool
    context_length_setting: int | None = None

    @property
    def info(self) -> ModelInfo | None:
        return self.pool.served

    @property
    def name(self) -> str | None:
        return self.pool.served.model if self.pool.served else None

    @property
    def context_length(self) -> int | None:
        if self.context_length_setting is not None:
            return self.context_length_setting
        return self.pool.served.max_model_len if self.pool.served else None
