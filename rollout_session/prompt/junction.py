"""Turn junctions: what follows an answer's sampled ids in the next prompt.

The template renders an assistant turn in history as its content (and tool
calls), then a *history terminator* (``<|im_end|>\\n``, ``<|eot_id|>``,
harmony's ``<|end|>``, nothing for GLM), then the next messages. The model
sampled the content and a stop token; the next prompt must continue from
exactly what it sampled. `Junction` is that continuation as rendered after a
synthetic context, with the terminator's length measured against the
template's *last-turn* terminator (``T_last``, what the model was trained to
emit: ``<|im_end|>``, harmony's ``<|return|>``):

- ``h = len(T_last)`` when history writes the same terminator;
- ``h = 1`` when history writes another single special token in its place
  (harmony: ``<|end|>`` for ``<|return|>``);
- ``h = 0`` when the template writes none (GLM: the model's stop token is the
  next role marker, ``<|user|>`` or ``<|observation|>``).

`continuation` then applies three rules, in order, to the sampled ids S and
the rendered continuation J (terminator + new messages + generation prompt):

1. *Overlap*: the longest k ≤ h + 1 with ``S[-k:] == J[:k]`` is already there
   (ChatML: the sampled ``<|im_end|>``; GLM: the sampled ``<|user|>`` that
   starts the next message) → ``J[k:]``.
2. *Stop token stands in*: the turn ended on a special stop token that is
   not the history terminator (Llama's ``<|eom_id|>`` for ``<|eot_id|>``,
   harmony's ``<|return|>`` for ``<|end|>``) → ``J[1:]``: the sampled token
   stays (it has a logprob) and the template's terminator is not added.
3. Otherwise (cut by ``max_tokens``, a stop string) → all of J.

Sampled ids are never changed: where the template's history differs from
what was sampled (harmony writes ``<|end|>`` where the model sampled
``<|return|>``), the trajectory keeps what the model saw and sampled, and
`check-template` names the difference.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..tokens import IdArray

__all__ = ["STOPPED", "Junction", "continuation", "shared_prefix", "terminator_length"]

# Finish reasons of a turn that ended on a stop condition (its last sampled id
# is the stop token when that is a token; `length` and `abort` were cut).
STOPPED = frozenset({"stop", "tool_calls"})


@dataclass(frozen=True, slots=True)
class Junction:
    """The template's continuation after an assistant turn's content."""

    ids: tuple[int, ...]  # J: history terminator, new messages, generation prompt
    terminator: int  # h: how many of `ids` are the history terminator


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def terminator_length(
    last: Sequence[int], history: Sequence[int], special_ids: Collection[int]
) -> int:
    """h (see the module docstring) from the last-turn terminator's ids and
    the history continuation's ids."""
    if not last:
        return 0
    if list(history[: len(last)]) == list(last):
        return len(last)
    return 1 if history and history[0] in special_ids else 0


def continuation(
    sampled: Sequence[int] | IdArray,
    junction: Junction,
    *,
    stopped: bool,
    special_ids: Collection[int],
) -> list[int]:
    """The prompt ids that follow `sampled` (see the module docstring).

    `stopped`: the turn ended on a stop condition (not ``length``/``abort``).
    """
    ids = junction.ids
    tail = [int(t) for t in sampled[-(junction.terminator + 1) :]]
    for k in range(min(len(tail), len(ids)), 0, -1):
        if tail[-k:] == list(ids[:k]):
            return list(ids[k:])
    if stopped and junction.terminator and tail and tail[-1] in special_ids:
        return list(ids[1:])
    return list(ids)
