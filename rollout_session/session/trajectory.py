"""The token trajectory of one session: compact arrays plus per-turn records.

Invariants (checked by `Trajectory.check`, relied on by export):
- ``ids``, ``logprobs`` and ``mask`` always have the same length;
- turn spans tile the sequence in order: turn 0 starts at 0, each turn's
  ``prompt_start`` is the previous turn's ``completion_end`` and the last
  turn's ``completion_end`` is the length of the sequence;
- ``mask`` is 1 exactly on sampled tokens (each turn's completion span), and
  ``logprobs`` is 0.0 wherever ``mask`` is 0.

Storage is what the invariants leave to store: int32 ids (4 bytes per token)
and float32 logprobs of sampled tokens only (4 bytes per *sampled* token: they
are 0.0 elsewhere by definition), per commit one exactly sized,
never-written-again array of each. ``mask`` and the full-length
``ids``/``logprobs`` are built on demand (fresh arrays: export, snapshots,
the next turn's ``input_ids``, which `plan_turn` copies anyway). Chunks are
never grown or reallocated: an idle session holds no growth slack, a commit
is O(new tokens) and leaves no freed history-sized buffer behind.

Routed experts (R3, opt-in) are one int32 blob of ``width`` values per
forwarded position. Every turn forwards all tokens but the last sampled one,
so after a turn the blob covers exactly ``len(tokens) - 1`` positions; each
turn asks the worker only for positions past what is stored (O(N) in total).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..tokens import IdArray, LogprobArray, VersionSpan
from .rescores import Rescore

__all__ = ["Checkpoint", "Continuation", "TokenBuffer", "Trajectory", "Turn", "tiles"]

MaskArray = npt.NDArray[np.uint8]


_I4 = np.dtype(np.int32)
_F4 = np.dtype(np.float32)
_NO_LOGPROBS: LogprobArray = np.empty(0, _F4)  # shared by prompt-only chunks


class TokenBuffer:
    """Append-only token chunks, each a prompt part (mask 0) then a sampled
    part (mask 1, with logprobs).

    Chunk k is an exactly sized int32 array of ids, with its sampled
    logprobs in ``_logprobs[k]`` (float32, ``end - middle`` of them), where
    ``_bounds[2k]`` and ``_bounds[2k + 1]`` are its ``middle, end``
    (positions in the sequence) and ``start`` is the previous chunk's end (0
    for the first). Positions ``[middle, end)`` are the chunk's sampled run.
    Ids apart from logprobs so that `prefix_ids` (every turn) concatenates
    whole chunks without slicing them, the cheapest of the ways tried
    (docs/performance.md#compact-token-arrays).
    Chunks are never written after their commit, so views of them stay valid.
    """

    __slots__ = ("_bounds", "_chunks", "_logprobs", "_num_sampled")

    def __init__(self) -> None:
        self._chunks: list[IdArray] = []
        self._logprobs: list[LogprobArray] = []
        # array('i') is not tracked by the GC and holds 4 bytes per entry.
        self._bounds = array("i")
        self._num_sampled = 0

    def __len__(self) -> int:
        return self._bounds[-1] if self._bounds else 0

    @property
    def nbytes(self) -> int:
        return (
            sum(c.nbytes for c in self._chunks)
            + sum(lp.nbytes for lp in self._logprobs)
            + len(self._bounds) * self._bounds.itemsize
        )

    @property
    def num_sampled(self) -> int:
        return self._num_sampled

    def _spans(self, first: int = 0) -> list[tuple[int, int, int]]:
        """(start, middle, end) of every chunk from the `first`-th on."""
        b = self._bounds
        return [(b[i - 1] if i else 0, b[i], b[i + 1]) for i in range(2 * first, len(b), 2)]

    def bounds(self) -> array[int]:
        """A copy of the chunks' bounds (each chunk's middle and end, in order)."""
        return self._bounds[:]

    def starts_with(self, bounds: array[int]) -> bool:
        """Whether the chunks begin with those `bounds` describe, unchanged
        (compared in C: O(chunks) at memcmp's speed)."""
        return self._bounds[: len(bounds)] == bounds

    def append(
        self,
        prompt_ids: Sequence[int] | IdArray,
        sampled_ids: IdArray | None = None,
        sampled_logprobs: LogprobArray | None = None,
    ) -> None:
        """Append prompt tokens (mask 0) then sampled tokens (mask 1) as one chunk."""
        sampled = np.empty(0, _I4) if sampled_ids is None else sampled_ids
        logprobs = np.empty(0, _F4) if sampled_logprobs is None else sampled_logprobs
        if len(sampled) != len(logprobs):
            raise ValueError("ids and logprobs differ in length")
        start = len(self)
        middle = start + len(prompt_ids)
        end = middle + len(sampled)
        if end == start:
            return
        chunk = np.empty(end - start, _I4)
        chunk[: middle - start] = prompt_ids
        chunk[middle - start :] = sampled
        self._chunks.append(chunk)
        self._logprobs.append(np.array(logprobs, _F4) if end > middle else _NO_LOGPROBS)
        self._bounds.extend((middle, end))
        self._num_sampled += end - middle

    def truncate(self, size: int) -> None:
        if not 0 <= size <= len(self):
            raise ValueError(f"cannot truncate {len(self)} tokens to {size}")
        while self._chunks and len(self) > size:
            k = len(self._chunks) - 1
            start, middle, end = self._spans()[k]
            ids = self._chunks[k]
            logprobs = self._logprobs[k]
            del self._chunks[k]
            del self._logprobs[k]
            del self._bounds[2 * k :]
            self._num_sampled -= end - middle
            if start < size:  # cut inside this chunk: keep its head
                cut = size - start
                self.append(
                    ids[: min(cut, middle - start)],
                    ids[middle - start : cut],
                    logprobs[: max(size - middle, 0)],
                )

    def runs(self, first: int = 0) -> list[tuple[int, int]]:
        """The sampled runs (start, end), in order: one per chunk that has
        one, from the `first`-th chunk on."""
        return [(middle, end) for _, middle, end in self._spans(first) if middle < end]

    def prefix_ids(self, end: int, then: Sequence[int] | IdArray = ()) -> IdArray:
        """``ids[:end]`` followed by `then`, as one fresh array (one copy)."""
        tail = np.asarray(then, _I4)
        if end == len(self):  # the common case: every turn kept
            return np.concatenate([*self._chunks, tail])
        parts: list[Any] = []
        for k, (start, _, stop) in enumerate(self._spans()):
            if start >= end:
                break
            parts.append(self._chunks[k][: min(stop, end) - start])
        parts.append(tail)
        return np.concatenate(parts)

    def _within_chunk(self, start: int, end: int) -> tuple[int, int, int, int] | None:
        """The first chunk (k, its start, middle, end) holding ``[start,
        end)``, or None if the range spans several. O(log chunks): the bounds
        are sorted (each chunk's middle and end, then the next chunk's), and
        the chunk is the first whose end is at least `end`."""
        b = self._bounds
        k = bisect.bisect_left(b, end) // 2
        if 2 * k + 1 >= len(b):
            return None
        s, m, e = (b[2 * k - 1] if k else 0), b[2 * k], b[2 * k + 1]
        return (k, s, m, e) if s <= start and end <= e else None

    def ids_between(self, start: int, end: int) -> IdArray:
        """``ids[start:end]``; a view when it lies in one chunk (one turn)."""
        found = self._within_chunk(start, end)
        if found is None:
            return self.ids[start:end]
        k, s, _, _e = found
        return self._chunks[k][start - s : end - s]

    def sampled_logprobs(self, start: int, end: int) -> LogprobArray:
        """Logprobs of ``[start, end)``; a view when it lies in one chunk's
        sampled run (a turn's completion span), no O(history) work."""
        found = self._within_chunk(start, end)
        if found is None or start < found[2]:
            return self.logprobs[start:end]
        k, _s, m, _e = found
        return self._logprobs[k][start - m : end - m]

    # Whole-sequence arrays: fresh, O(length). For export, snapshots, tests.
    @property
    def ids(self) -> IdArray:
        return self.prefix_ids(len(self))

    @property
    def logprobs(self) -> LogprobArray:
        out = np.zeros(len(self), _F4)
        for k, (_start, middle, end) in enumerate(self._spans()):
            out[middle:end] = self._logprobs[k]
        return out

    @property
    def mask(self) -> MaskArray:
        out = np.zeros(len(self), np.uint8)
        for middle, end in self.runs():
            out[middle:end] = 1
        return out


@dataclass(slots=True, frozen=True)
class Turn:
    """One committed turn. Spans index the session's token sequence."""

    index: int
    prompt_start: int
    completion_start: int
    completion_end: int
    # Conversation length (stored messages) after this turn: the rollback checkpoint.
    messages_end: int
    finish_reason: str | None
    worker: str
    weight_version: str | None  # the version of its last sampled token
    cached_tokens: int | None
    upstream_latency_s: float
    created_at: float
    # The policy of each sampled token: spans tiling [0, completion_end -
    # completion_start) in order, offsets from completion_start; empty for a
    # turn that sampled nothing (and in journals written before spans).
    weight_versions: tuple[VersionSpan, ...] = ()
    # The requests after the first, when its worker aborted the turn and it
    # was continued (docs/training.md#interrupted-turns).
    continuations: tuple[Continuation, ...] = ()
    # The sampling parameters the engine sent for it (None where the worker's
    # own default applied; None for turns journaled before they were kept).
    sampling: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> Turn:
        """A turn from its journaled fields (spans and continuations as lists)."""
        return cls(
            **{
                **fields,
                "weight_versions": tuple(
                    VersionSpan(*s) for s in fields.get("weight_versions", ())
                ),
                "continuations": tuple(Continuation(*c) for c in fields.get("continuations", ())),
            }
        )


def tiles(spans: Sequence[VersionSpan], n: int) -> bool:
    """Whether `spans` tile [0, n) in order, each non-empty."""
    at = 0
    for span in spans:
        if span.start != at or span.end <= span.start:
            return False
        at = span.end
    return at == n


class Continuation(NamedTuple):
    """One more request a turn took after its worker aborted it (a weight
    update, a pause): the turn's prompt plus the tokens sampled so far."""

    start: int  # offset from completion_start where this request's tokens begin
    worker: str  # the worker that took it (another one after a failover)
    prompt_tokens: int  # what it sent: the turn's prompt + the tokens before `start`
    cached_tokens: int | None  # of those, reused from the worker's cache (the rest re-prefilled)
    # Tokens sampled before it and dropped: the engine could not continue
    # them exactly (a grammar-constrained turn, or an engine that cannot),
    # so the turn was sampled again from its prompt (`start` is then 0).
    discarded: int = 0


class Checkpoint(NamedTuple):
    """What a commit keeping `keep_turns` turns is about to replace, so that
    `Trajectory.undo` can put it back. The dropped turns' tokens are views of
    their chunks (never written again), so a checkpoint copies nothing but
    the routed experts a rollback would cut. (A tuple: it is taken before
    every journaled commit.)"""

    keep_turns: int
    dropped: list[tuple[Turn, IdArray, LogprobArray]]  # turns past keep_turns
    experts_from: int  # byte offset the commit may cut the experts at
    experts_tail: bytes  # the experts stored past it
    experts_width: int | None


class Trajectory:
    """Token sequence and turn records of one session."""

    __slots__ = (
        "_verified_bounds",
        "_verified_sampled",
        "_verified_turns",
        "experts",
        "experts_width",
        "rescores",
        "tokens",
        "turns",
    )

    def __init__(self) -> None:
        self.tokens = TokenBuffer()
        self.turns: list[Turn] = []
        # What the last passing `check` verified: its turns, the token
        # chunks' bounds and the sampled tokens they hold. While those turns
        # and bounds still begin the trajectory, only later turns are checked
        # again. (A tuple and an array: one more GC-tracked object a session.)
        self._verified_turns: tuple[Turn, ...] = ()
        self._verified_bounds = array("i")
        self._verified_sampled = 0
        # By label; each covers a prefix of the tokens (cut with them).
        self.rescores: dict[str, Rescore] = {}
        # Little-endian int32 routed-expert ids, `experts_width` per position.
        self.experts = bytearray()
        self.experts_width: int | None = None

    def expert_positions(self, num_turns: int) -> int:
        """Positions with routed experts once `num_turns` turns are kept."""
        return max(self.length_after(num_turns) - 1, 0)

    def __len__(self) -> int:
        return len(self.tokens)

    def length_after(self, num_turns: int) -> int:
        """Sequence length once only the first `num_turns` turns are kept."""
        return self.turns[num_turns - 1].completion_end if num_turns else 0

    def sampled_ids(self, turn_index: int) -> IdArray:
        turn = self.turns[turn_index]
        return self.tokens.ids_between(turn.completion_start, turn.completion_end)

    def sampled_logprobs(self, turn_index: int) -> LogprobArray:
        turn = self.turns[turn_index]
        return self.tokens.sampled_logprobs(turn.completion_start, turn.completion_end)

    def commit(
        self,
        *,
        keep_turns: int,
        prompt_ids: Sequence[int] | IdArray,
        sampled_ids: IdArray,
        sampled_logprobs: LogprobArray,
        turn: Turn,
        experts: bytes | None = None,
        experts_width: int | None = None,
    ) -> None:
        """Drop turns past `keep_turns` (rollback), then append one turn.

        Plain synchronous code: the caller holds the session's turn slot, so no
        other task can observe the trajectory between truncation and append.
        """
        if experts is not None and self.experts_width is not None:
            del self.experts[self.expert_positions(keep_turns) * 4 * self.experts_width :]
        del self.turns[keep_turns:]
        self._truncate(self.length_after(keep_turns))
        self.tokens.append(prompt_ids, sampled_ids, sampled_logprobs)
        self.turns.append(turn)
        if experts is not None:
            self.experts += experts
            self.experts_width = experts_width

    def _truncate(self, length: int) -> None:
        """Cut the tokens, and every rescore with them (past `length` it
        scored tokens that are no longer the segment's)."""
        self.tokens.truncate(length)
        for label, rescore in self.rescores.items():
            self.rescores[label] = rescore.cut(length)

    def checkpoint(self, keep_turns: int) -> Checkpoint:
        """Before `commit(keep_turns=...)`: what it replaces. O(1) unless it rolls back."""
        tokens = self.tokens
        dropped = [
            (t, tokens.ids_between(t.prompt_start, t.completion_end), self.sampled_logprobs(i))
            for i, t in enumerate(self.turns[keep_turns:], keep_turns)
        ]
        width = self.experts_width
        if width is None:
            return Checkpoint(keep_turns, dropped, 0, b"", None)
        cut = min(self.expert_positions(keep_turns) * 4 * width, len(self.experts))
        return Checkpoint(keep_turns, dropped, cut, bytes(self.experts[cut:]), width)

    def undo(self, checkpoint: Checkpoint) -> None:
        """Drop the turn committed after `checkpoint` and put back what it replaced."""
        keep = checkpoint.keep_turns
        del self.turns[keep:]
        self._truncate(self.length_after(keep))
        for turn, ids, logprobs in checkpoint.dropped:
            split = turn.completion_start - turn.prompt_start
            self.tokens.append(ids[:split], ids[split:], logprobs)
            self.turns.append(turn)
        del self.experts[checkpoint.experts_from :]
        self.experts += checkpoint.experts_tail
        self.experts_width = checkpoint.experts_width

    def check(self) -> str | None:
        """Return a description of the first broken invariant, or None.

        Not O(tokens): the arrays agree in length by construction (mask and
        logprobs are derived from the chunks); what can break is the chunks
        disagreeing with the turns. It runs before every turn, so what the
        last passing check verified is not checked again while it is
        unchanged: its turns (the same objects, or equal ones) and its
        chunks' bounds, compared in C, still begin the trajectory. Only the
        turns and chunks after them take the checks in Python: O(new turns)
        (docs/performance.md#checks-that-do-not-grow-with-the-history).
        """
        tokens, turns = self.tokens, self.turns
        first = position = sampled = chunks = 0
        verified = self._verified_turns
        if (
            verified
            and tuple(turns[: len(verified)]) == verified
            and tokens.starts_with(self._verified_bounds)
        ):
            first = len(verified)
            position = turns[first - 1].completion_end
            sampled = self._verified_sampled
            chunks = len(self._verified_bounds) // 2
        spans = []
        for i in range(first, len(turns)):
            turn = turns[i]
            if turn.index != i:
                return f"turn {i} has index {turn.index}"
            if not position == turn.prompt_start <= turn.completion_start <= turn.completion_end:
                return f"turn {i} span does not tile the sequence"
            position = turn.completion_end
            if turn.weight_versions and not tiles(
                turn.weight_versions, turn.completion_end - turn.completion_start
            ):
                return f"turn {i} weight_versions do not tile its sampled tokens"
            if turn.completion_start < turn.completion_end:
                spans.append((turn.completion_start, turn.completion_end))
        if position != len(tokens):
            return f"turns cover {position} tokens but the sequence has {len(tokens)}"
        runs = tokens.runs(chunks)
        if runs != spans:
            return f"sampled runs {runs} are not the turns' completion spans {spans}"
        sampled += sum(end - start for start, end in runs)
        if tokens.num_sampled != sampled:
            return "sampled logprobs do not match the sampled runs"
        self._verified_turns = tuple(turns)
        self._verified_bounds = tokens.bounds()
        self._verified_sampled = sampled
        return None
