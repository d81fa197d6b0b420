"""The engine seam: how a turn asks an inference engine for one completion.

The turn runner hands an `Engine` the session (its id and worker pin) and an
`EngineRequest` — the exact prompt ids and the agent's parsed request — and
gets back a `Completion` (validated: what the trajectory records and what
the agent is answered with) or a `Refusal` (the engine's own non-200 answer,
which the agent gets as it came; nothing is committed). Nothing above this
seam knows which engine answered.

An engine owns everything in between: which worker (the pool: placement,
failover), the wire format, strict validation of the answer (run where the
`Validation` it was given puts it), and the worker's health accounting.

Two capabilities later engines need are part of the seam's shape:
- Continuing a partial completion (`EngineRequest.partial`, built by
  `EngineRequest.continued`): when a worker aborts a completion (a weight
  update, a pause), the turn runner asks for its continuation, and the
  engine answers with the whole stitched completion, parsed as one. An
  engine that cannot continue this one exactly raises `CannotContinue`
  instead of sampling (the runner then samples the turn afresh).
- Per-session engine state: `adopt` and `release` bracket a session's life
  on the engine (a session restored from the journal; one closed, expired
  or forgotten). Between them an engine may keep what it needs per session
  id; after `release` it keeps nothing of that session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from ..prompt.tokenizer import ChatTokenizer
from ..tokens import IdArray, LogprobArray, VersionSpan

__all__ = [
    "AgentReply",
    "CannotContinue",
    "Completion",
    "Engine",
    "EngineCounter",
    "EngineRequest",
    "EngineSession",
    "Partial",
    "Refusal",
    "Validation",
]

A = TypeVar("A")
R = TypeVar("R")


class EngineSession(Protocol):
    """What an engine sees of a session: its id and its worker pin. The
    engine (its pool) is the one writer of `worker`; the session store
    journals and exports it."""

    @property
    def id(self) -> str: ...

    worker: str | None


@dataclass(frozen=True, slots=True)
class Partial:
    """A completion interrupted before it finished: what was sampled so far
    (at least one token). In a continuing request these are the last ids of
    its `input_ids`."""

    ids: IdArray
    logprobs: LogprobArray
    weight_versions: tuple[VersionSpan, ...]  # tiling `ids`
    experts: tuple[bytes, int] | None  # R3: their routed experts and width, if asked
    # What the engine kept to continue it (its `Completion.engine_state`).
    engine_state: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """One completion to sample: the exact prompt and the agent's request."""

    # The agent's request body as parsed and checked (sampling parameters,
    # tools, stop, response_format, …): the engine translates it.
    params: Mapping[str, Any]
    input_ids: IdArray  # all the worker is sent: the prompt (and `partial`'s ids)
    template_kwargs: Mapping[str, Any]  # the chat-template kwargs the prompt was rendered with
    vocab_size: int  # the tokenizer's: a sampled id at or above it is refused
    max_tokens: int | None = None  # the session cap's remainder, for a request that set no limit
    priority: int | None = None  # the session's scheduling priority
    experts_from: int | None = None  # R3: routed experts from this position on; None: not asked
    experts_width: int | None = None  # values per position stored so far (None: none yet)
    partial: Partial | None = None  # continue this completion (engines that can)
    # An aborted answer will be continued, never answered or committed: the
    # engine may skip parsing it and writing its reply.
    aborts_continue: bool = False

    @property
    def sampled_before(self) -> int:
        """Tokens of the completion sampled before this request (its partial's)."""
        return len(self.partial.ids) if self.partial is not None else 0

    def continued(self, partial: Partial) -> EngineRequest:
        """The request that continues `partial`, a completion of this
        (first) request its worker aborted: the worker is sent the prompt
        and the partial's ids, and every limit counts what was sampled —
        the agent's max_tokens and min_tokens, the session cap's remainder,
        and routed experts from the first position not yet reported."""
        done = len(partial.ids)
        params = dict(self.params)
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(params.get(key), int):
                params[key] -= done  # > 0: a worker never aborts at the limit
        if isinstance(params.get("min_tokens"), int):
            params["min_tokens"] = max(params["min_tokens"] - done, 0)
        prompt = len(self.input_ids)
        return replace(
            self,
            params=params,
            input_ids=np.concatenate([self.input_ids, partial.ids]).astype(np.int32),
            max_tokens=None if self.max_tokens is None else self.max_tokens - done,
            # The aborted answer reported positions up to its last sampled
            # token, which it never forwarded.
            experts_from=None if self.experts_from is None else prompt + done - 1,
            experts_width=self.experts_width if partial.experts is None else partial.experts[1],
            partial=partial,
        )


@dataclass(frozen=True, slots=True)
class AgentReply:
    """What the agent is answered with: an OpenAI chat completion (status
    200) or the engine's own error, with the headers an agent may see."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """A validated completion: everything the turn records, and the reply."""

    # The sampled ids, in order (a continuation: the partial's, then its own).
    ids: IdArray
    logprobs: LogprobArray  # one finite logprob ≤ 0 per sampled id
    content: str | None
    tool_calls: list[dict[str, Any]]
    reasoning_content: str | None
    finish_reason: str | None  # "abort": the worker interrupted it (a weight update, a pause)
    model: str | None  # the model the engine says answered
    # The policy versions the engine reports, tiling `ids` (a version is
    # None where it reports none).
    weight_versions: tuple[VersionSpan, ...]
    cached_tokens: int | None  # prompt tokens the engine reused from its cache (this request's)
    # R3: little-endian int32 routed-expert ids of the new positions, and
    # values per position (None: not asked for).
    experts: tuple[bytes, int] | None
    worker: str  # the worker that generated it (behind a gateway, the one it routed to)
    latency_s: float  # the engine's time for the request
    reply: AgentReply
    # What this engine needs to continue the completion if it was aborted
    # (opaque above the seam; handed back as `Partial.engine_state`).
    engine_state: Any = None
    # The sampling parameters it sent the worker (`engines.sampling.applied`).
    sampling: Mapping[str, Any] | None = None

    @property
    def weight_version(self) -> str | None:
        """The version of the last sampled token."""
        return self.weight_versions[-1].version if self.weight_versions else None


@dataclass(frozen=True, slots=True)
class Refusal:
    """The engine's own error answer (e.g. a prompt it finds too long): the
    agent gets it as it came, and nothing of the turn is committed."""

    reply: AgentReply
    worker: str


class CannotContinue(Exception):
    """Asked to continue a partial completion the engine cannot continue
    exactly (the message says why)."""


class Validation(Protocol):
    """Where an engine's pure answer check runs (inline, on a thread, in a
    process: the turn wing's `AnswerValidator` decides by `cost`). `check`
    must be a picklable module-level function."""

    async def validate(
        self, check: Callable[[bytes, A], R], body: bytes, arg: A, cost: int
    ) -> R: ...


@dataclass(frozen=True, slots=True)
class EngineCounter:
    """A count an engine keeps of its own work, for ``/metrics``."""

    name: str  # the metric's name (a counter: ``_total`` is added)
    help: str
    labels: tuple[str, ...]  # () for one unlabelled count
    # A count per tuple of label values (``{(): n}`` without labels).
    values: Mapping[tuple[str, ...], int]


class Engine(Protocol):
    """One inference engine behind the seam (docs/architecture.md#the-engine-seam)."""

    # Whether `complete` may take `EngineRequest.partial` (else always CannotContinue).
    can_continue: ClassVar[bool]

    async def prepare(self, tokenizer: ChatTokenizer) -> None:
        """Start-up, once the tokenizer is loaded: read what the engine needs
        of the model's files (the tokenizer's directory, ``name_or_path``)."""

    def counters(self) -> Iterable[EngineCounter]:
        """Its counters, read at each scrape of ``/metrics``."""

    async def complete(
        self, session: EngineSession, request: EngineRequest
    ) -> Completion | Refusal:
        """Sample one completion for `session`; raise the error tree's
        `UpstreamError` family (nothing sampled, or nothing usable)."""
        ...

    def adopt(self, session: EngineSession) -> None:
        """Take back a session restored with its worker pin."""

    def release(self, session: EngineSession) -> None:
        """The session takes no more turns: drop its pin and engine state."""

    async def close_worker_sessions(self, sessions: Iterable[EngineSession]) -> None:
        """Shutdown: free what workers hold for these sessions now (best
        effort, bounded by the pool's health timeout)."""
