"""The trainer's sampling, pinned on a session (docs/api.md#pinned-sampling).

RL needs the behaviour policy to be the trainer's: an agent framework that
sends ``temperature: 0.7`` changes the distribution the logprobs come from.
``POST /sessions`` takes ``sampling`` (`parse_sampling`); every turn of the
session then samples with it whatever the agent sends (`pin`): an agent
value that differs is overridden (counted in
``rollout_sampling_conflicts_total``), or refused under
``--on-sampling-conflict refuse``. ``max_tokens`` is a cap: a smaller agent
limit stands, a larger one (or none) becomes the cap. The agent's answer
keeps its shape either way; each turn records the sampling parameters the
engine sent (`engines.sampling`, ``turns[].sampling`` in the export).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final, NamedTuple

from ..errors import InvalidRequest
from .request import ChatRequest

__all__ = ["PINNED_KEYS", "Conflict", "OnSamplingConflict", "parse_sampling", "pin"]


class OnSamplingConflict(enum.Enum):
    # The session's value is sent; the agent's is counted and dropped.
    OVERRIDE = "override"
    # The turn is refused with a 400 naming the parameter; nothing is sent.
    REFUSE = "refuse"


def _number(low: float, high: float) -> Any:
    def check(value: Any) -> bool:
        return (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and low <= value <= high
        )

    check.__doc__ = f"a number in [{low:g}, {high:g}]"
    return check


def _integer(low: int, high: int) -> Any:
    def check(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    check.__doc__ = f"an integer in [{low}, {high}]"
    return check


# What a session may pin, each with the values the chat request takes for it
# (turn/request.py) where it checks one, the engines' otherwise.
PINNED_KEYS: Final[Mapping[str, Any]] = {
    "temperature": _number(0.0, 2.0),
    "top_p": _number(0.0, 1.0),
    "top_k": _integer(-1, 2**31 - 1),
    "min_p": _number(0.0, 1.0),
    "presence_penalty": _number(-2.0, 2.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "repetition_penalty": _number(0.0, 2.0),
    "seed": _integer(-(2**63), 2**64 - 1),
    "max_tokens": _integer(1, 2**31 - 1),  # a cap
}


def parse_sampling(value: Any) -> dict[str, Any] | None:
    """``POST /sessions``'s ``sampling``: absent or null, or an object of
    `PINNED_KEYS` with valid values (`InvalidRequest` naming the key)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("sampling must be an object", param="sampling")
    unknown = sorted(set(value) - set(PINNED_KEYS))
    if unknown:
        raise InvalidRequest(
            f"sampling takes {', '.join(PINNED_KEYS)}; not {', '.join(unknown)}",
            param=f"sampling.{unknown[0]}",
        )
    for key, item in value.items():
        check = PINNED_KEYS[key]
        if not check(item):
            raise InvalidRequest(f"sampling.{key} must be {check.__doc__}", param=f"sampling.{key}")
    return dict(value)


class Conflict(NamedTuple):
    """An agent's value the session's sampling replaced (or refused)."""

    param: str
    asked: Any
    pinned: Any


def pin(
    request: ChatRequest, sampling: Mapping[str, Any] | None, on_conflict: OnSamplingConflict
) -> tuple[ChatRequest, list[Conflict]]:
    """`request` sampling with the session's `sampling`, and where the agent
    asked otherwise (refused under `OnSamplingConflict.REFUSE`)."""
    if not sampling:
        return request, []
    raw = dict(request.raw)
    conflicts: list[Conflict] = []
    for key, value in sampling.items():
        if key == "max_tokens":
            continue
        asked = raw.get(key)
        if asked is not None and asked != value:
            conflicts.append(Conflict(key, asked, value))
        raw[key] = value
    max_tokens = request.max_tokens
    cap = sampling.get("max_tokens")
    if cap is not None and (max_tokens is None or max_tokens > cap):
        if max_tokens is not None:
            key = "max_completion_tokens" if "max_completion_tokens" in raw else "max_tokens"
            conflicts.append(Conflict(key, max_tokens, cap))
        for key in ("max_tokens", "max_completion_tokens"):
            if raw.get(key) is not None or key == "max_tokens":
                raw[key] = cap
        max_tokens = cap
    if conflicts and on_conflict is OnSamplingConflict.REFUSE:
        key, asked, value = conflicts[0]
        raise InvalidRequest(
            f"{key}={asked} conflicts with the session's sampling ({key}={value}); "
            "the server refuses conflicts (--on-sampling-conflict refuse): send the "
            "session's value or none",
            param=key,
        )
    return replace(request, raw=raw, max_tokens=max_tokens), conflicts
