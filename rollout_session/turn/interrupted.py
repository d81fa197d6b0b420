"""Turns their worker interrupted (docs/training.md#interrupted-turns).

A worker answers `abort` when a weight update, a pause or an abort request
stops a completion midway. `OnAbort` says what the turn runner does then;
`Interruption` is what it keeps between the aborted answer and the request
that continues it; `relabel` names the policy of tokens the engine left
unnamed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engines.base import Completion, EngineRequest, Partial
from ..session.trajectory import Continuation
from ..tokens import VersionSpan

__all__ = ["ENGINE_DEFAULT_VERSION", "Interruption", "OnAbort", "relabel"]

# The label SGLang (server_args.weight_version) and vLLM (EngineCore
# _weight_version) report until someone sets one: no version at all.
ENGINE_DEFAULT_VERSION = "default"


class OnAbort(enum.Enum):
    # Keep the partial completion and ask for the rest once the server is
    # not paused: the agent gets one answer, the trajectory every token.
    CONTINUE = "continue"
    # Commit and answer the aborted completion as it came (trainers that
    # drop such turns).
    RETURN = "return"


def relabel(
    spans: tuple[VersionSpan, ...], since: int, declared: str | None
) -> tuple[VersionSpan, ...]:
    """Spans from offset `since` on (a request's own tokens) that the engine
    left unnamed (None, or its unset label) take the version the trainer
    declared when the request was sent; equal neighbours merge."""
    out: list[VersionSpan] = []
    for span in spans:
        version = span.version
        if (
            declared is not None
            and span.start >= since
            and version in (None, ENGINE_DEFAULT_VERSION)
        ):
            version = declared
        if out and out[-1].version == version and out[-1].end == span.start:
            out[-1] = VersionSpan(out[-1].start, span.end, version)
        else:
            out.append(VersionSpan(span.start, span.end, version))
    return tuple(out)


@dataclass(slots=True)
class Interruption:
    """A turn's requests after its first: one `Continuation` per request,
    completed by its answer."""

    first: EngineRequest
    continuations: list[Continuation] = field(default_factory=list)
    # The first request's worker and cache (the turn's own), and the
    # engine's time over all requests.
    worker: str = ""
    cached_tokens: int | None = None
    latency_s: float = 0.0
    # The sampling parameters of the first request's answer (the turn's).
    sampling: Mapping[str, Any] | None = None

    def next_request(self, aborted: Completion) -> EngineRequest:
        """The request after `aborted`: its continuation, or the first
        request again when nothing was sampled."""
        if not len(aborted.ids):
            request = self.first
        else:
            request = self.first.continued(
                Partial(
                    aborted.ids,
                    aborted.logprobs,
                    aborted.weight_versions,
                    aborted.experts,
                    aborted.engine_state,
                )
            )
        self._begin(request, discarded=0)
        return request

    def resample(self, request: EngineRequest) -> EngineRequest:
        """The engine cannot continue `request`: sample the turn afresh,
        dropping what its partial holds."""
        self.continuations.pop()
        return self.restart(request.sampled_before)

    def restart(self, dropped: int) -> EngineRequest:
        """Sample the turn afresh, `dropped` sampled tokens thrown away."""
        self._begin(self.first, discarded=dropped)
        return self.first

    def answered(self, completion: Completion) -> None:
        """The last request's answer: its worker and cache."""
        self.latency_s += completion.latency_s
        if self.continuations:
            last = self.continuations[-1]
            self.continuations[-1] = last._replace(
                worker=completion.worker, cached_tokens=completion.cached_tokens
            )
        else:
            self.worker, self.cached_tokens = completion.worker, completion.cached_tokens
            self.sampling = completion.sampling

    @property
    def reprefilled(self) -> int:
        """Prompt tokens the continuations sent that their workers had not cached."""
        return sum(c.prompt_tokens - (c.cached_tokens or 0) for c in self.continuations)

    def _begin(self, request: EngineRequest, *, discarded: int) -> None:
        start = len(request.partial.ids) if request.partial is not None else 0
        self.continuations.append(Continuation(start, "", len(request.input_ids), None, discarded))
