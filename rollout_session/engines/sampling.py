"""The sampling parameters a completion records: what the engine sent its
worker, so the trainer knows the behaviour policy exactly
(``turns[].sampling`` in the export; docs/training.md#the-sampling-a-turn-used)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["SAMPLING_KEYS", "applied"]

# The parameters recorded, by their OpenAI names.
SAMPLING_KEYS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "seed",
)


def applied(sent: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Each of `SAMPLING_KEYS` as the engine sent it (`names`: the engine's
    name for a key, where it differs); None where it sent none and the
    worker applied its own default."""
    names = names or {}
    return {key: sent.get(names.get(key, key)) for key in SAMPLING_KEYS}
