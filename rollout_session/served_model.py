"""What the workers serve: the model's name and context length."""

from __future__ import annotations

from dataclasses import dataclass

from .upstream import ModelInfo

__all__ = ["ServedModel"]


@dataclass
class ServedModel:
    """Learned from a worker at start-up, or on the first ``/v1/models`` when
    no worker answered then (the served model does not change under a
    running server, so the first answer is kept)."""

    # --context-length, which wins over what the worker reports.
    context_length_setting: int | None = None
    info: ModelInfo | None = None

    @property
    def name(self) -> str | None:
        return self.info.model if self.info else None

    @property
    def context_length(self) -> int | None:
        if self.context_length_setting is not None:
            return self.context_length_setting
        return self.info.max_model_len if self.info else None
