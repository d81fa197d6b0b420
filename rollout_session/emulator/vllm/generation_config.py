"""vLLM 0.33.0's ``--generation-config`` and ``--override-generation-config``:
the model defaults a server applies to requests that set no sampling keys.

Paths under ``vllm/``. ``config/model.py`` ``ModelConfig.get_diff_sampling_param``:
the generation config (``"auto"``: the model directory's; ``"vllm"``:
none; a folder: that folder's; read by ``try_get_generation_config`` as
``GenerationConfig.from_pretrained(...).to_diff_dict()``), updated with the
override, then its nine sampling keys that are not None, ``max_new_tokens``
renamed ``max_tokens``. The chat route and ``/v1/chat/completions/render``
take every key a request leaves unset from it (CP ``to_sampling_params``);
``/inference/v1/generate`` and render take ``max_tokens`` and the cap
``override_max_tokens`` (``entrypoints/scale_out/token_in_token_out/serving.py``
``ServingTokens.__init__``, ``entrypoints/scale_out/render/serving.py``
``ServingRender.__init__``, both then ``entrypoints/serve/utils/api_utils.py``
``get_max_tokens``).

``to_diff_dict`` drops what equals ``GenerationConfig()``'s defaults; under
the transformers vLLM 0.33.0 requires (``>=5.16.1,<5.21``) every sampling
default is None, so every key the file sets is kept. Not modelled: the
fallback to ``config.json`` when a directory has no
``generation_config.json`` (``GenerationConfig.from_model_config``; the
emulator's model directories have no ``config.json``): no defaults then.
No import beyond the standard library (`EmulatorConfig` checks the flags).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = ["GENERATION_CONFIG_KEYS", "GenerationDefaults", "check_override", "generation_defaults"]

# get_diff_sampling_param's `available_params`, in its order.
GENERATION_CONFIG_KEYS: Final = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
    "skip_special_tokens",
)
# What SamplingParams takes for each key (the emulator refuses an override
# whose value vLLM would fail every request on).
_INTS: Final = frozenset({"top_k", "max_new_tokens"})


@dataclass(frozen=True)
class GenerationDefaults:
    """What a vLLM server applies to the requests that leave a key unset."""

    # get_diff_sampling_param(): the chat route's and render's defaults,
    # ``max_tokens`` included.
    sampling: Mapping[str, Any]
    # `override_max_tokens`: a cap even on an explicit max_tokens.
    max_tokens_cap: int | None


def check_override(override: Any) -> None:
    """Raise ValueError for an ``--override-generation-config`` vLLM refuses
    (``ModelConfig.override_generation_config: dict[str, Any]``, pydantic)
    or whose sampling keys every request would fail on (the emulator's
    refusal: vLLM answers each request with an error)."""
    if not isinstance(override, Mapping) or not all(isinstance(k, str) for k in override):
        raise ValueError("override_generation_config must be a JSON object")
    for key in GENERATION_CONFIG_KEYS:
        value = override.get(key)
        if value is None:
            continue
        if key == "skip_special_tokens":
            ok = isinstance(value, bool)
        elif key in _INTS:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            raise ValueError(
                f"the emulator does not model override_generation_config {key}={value!r} "
                "(vLLM fails every request that takes it)"
            )


def _read(folder: str | Path) -> dict[str, Any]:
    """``try_get_generation_config``: the folder's ``generation_config.json``
    (``to_diff_dict``: under vLLM's transformers, every key it sets), or {}."""
    try:
        config = json.loads((Path(folder) / "generation_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return dict(config) if isinstance(config, dict) else {}


def generation_defaults(
    model_dir: str | Path, generation_config: str, override: Mapping[str, Any] | None
) -> GenerationDefaults:
    """``get_diff_sampling_param`` and ``override_max_tokens`` of a server
    launched on ``model_dir`` with ``--generation-config generation_config``
    and ``--override-generation-config override``."""
    source = generation_config
    config = {} if source == "vllm" else _read(model_dir if source == "auto" else source)
    config.update(override or {})
    diff = {key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None}
    if "max_new_tokens" in diff:
        diff["max_tokens"] = diff.pop("max_new_tokens")
    # A folder's max_new_tokens caps every request; with auto or vllm only the
    # override's does.
    if source not in ("auto", "vllm"):
        cap = diff.get("max_tokens")
    else:
        cap = (override or {}).get("max_new_tokens")
    return GenerationDefaults(diff, cap)
