"""One agent turn, end to end: the runner and what it needs.

Owns: the turn runner (`runner`: claim → parse → plan → engine → commit),
the pure planning core (`plan`), token limits, parsing the agent's chat
request (`request`), where CPU-bound work and answer validation run
(`offload`, `validator`, `handoff`), the pause gate, the turns' metrics,
and rescoring a session's tokens under another policy (`rescore`).

May import: `engines`, `session`, `prompt`, `errors`, `tokens`. Nothing of
`http`: protocols hand it a body and get a `TurnOutcome` back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .plan import TurnPolicy, plan_turn
    from .runner import TurnOutcome, TurnRunner

__all__ = ["TurnOutcome", "TurnPolicy", "TurnRunner", "plan_turn"]

_HOME = {
    "TurnOutcome": ".runner",
    "TurnRunner": ".runner",
    "TurnPolicy": ".plan",
    "plan_turn": ".plan",
}

__getattr__, __dir__ = lazy_attributes(__name__, _HOME, __all__)
