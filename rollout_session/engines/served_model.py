"""What the workers serve: the model's name and context length, and the
`model` a turn is sent upstream with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .pool import ModelInfo, WorkerPool

__all__ = ["ServedModel"]

# --upstream-model's keywords; any other value is a model name sent as is.
UPSTREAM_MODEL_SERVED = "served"
UPSTREAM_MODEL_AGENT = "agent"


@dataclass(frozen=True)
class ServedModel:
    """A view of the pool's served model (learned by its admission checks:
    the first worker to pass names it, every other must list it), with
    ``--context-length`` winning over what the worker reports, and
    ``--upstream-model`` deciding the name turns are sent with."""

    pool: WorkerPool
    context_length_setting: int | None = None
    upstream_model: str = UPSTREAM_MODEL_SERVED

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

    def upstream_name(self, asked: Any) -> str | None:
        """The `model` a turn whose agent wrote `asked` is sent with (None:
        nothing known yet; the pool then has no worker to send it to)."""
        setting = self.upstream_model
        if setting == UPSTREAM_MODEL_AGENT:
            # The agent's own: a worker that serves adapters by name
            # (SGLang's LoRA "base:adapter") needs it as written.
            return asked if isinstance(asked, str) and asked else self.name
        if setting == UPSTREAM_MODEL_SERVED:
            name = self.name
            # SGLang's "served:adapter" names a LoRA adapter of the served
            # model, and vLLM lists its adapters by name: kept, so the
            # adapter is not silently dropped.
            if name and isinstance(asked, str) and asked.startswith(f"{name}:"):
                return asked
            info = self.info
            if info is not None and isinstance(asked, str) and asked in info.models:
                return asked
            # A gateway routes on it: any other name finds no worker there.
            return name
        return setting
