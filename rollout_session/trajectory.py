"""The token trajectory of one session: compact arrays plus per-turn records.

Invariants (checked by `Trajectory.check`, relied on by export):
- ``ids``, ``logprobs`` and ``mask`` always have the same length;
- turn spans tile the sequence in order: turn 0 starts at 0, each turn's
  ``prompt_start`` is the previous turn's ``completion_end`` and the last
  turn's ``completion_end`` is the length of the sequence;
- ``mask`` is 1 exactly on sampled tokens (each turn's completion span), and
  ``logprobs`` is 0.0 wherever ``mask`` is 0.

Storage is 9 bytes per token (int32 id, float32 logprob, uint8 mask) in
over-allocated numpy buffers (growth factor 1.25), so ≤ 16 B/token with slack.

Routed experts (R3, opt-in) are one int32 blob of ``width`` values per
forwarded position. Every turn forwards all tokens but the last sampled one,
so after a turn the blob covers exactly ``len(tokens) - 1`` positions; each
turn asks the worker only for positions past what is stored (O(N) in total).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["TokenBuffer", "Trajectory", "Turn"]

IdArray = npt.NDArray[np.int32]
LogprobArray = npt.NDArray[np.float32]
MaskArray = npt.NDArray[np.uint8]

_GROWTH = 1.25
_MIN_CAPACITY = 256


class TokenBuffer:
    """Growable parallel arrays of (token id, logprob, loss mask)."""

    __slots__ = ("_ids", "_logprobs", "_mask", "_size")

    def __init__(self) -> None:
        self._size = 0
        self._ids: IdArray = np.empty(0, np.int32)
        self._logprobs: LogprobArray = np.empty(0, np.float32)
        self._mask: MaskArray = np.empty(0, np.uint8)

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        return self._ids.nbytes + self._logprobs.nbytes + self._mask.nbytes

    def _reserve(self, size: int) -> None:
        capacity = len(self._ids)
        if size <= capacity:
            return
        new_capacity = max(size, int(capacity * _GROWTH), _MIN_CAPACITY)
        for name, dtype in (("_ids", np.int32), ("_logprobs", np.float32), ("_mask", np.uint8)):
            old = getattr(self, name)
            new = np.zeros(new_capacity, dtype)
            new[: self._size] = old[: self._size]
            setattr(self, name, new)

    def append_prompt(self, ids: Sequence[int] | IdArray) -> None:
        """Tokens the model read but did not sample: mask 0, logprob 0.0."""
        n = len(ids)
        end = self._size + n
        self._reserve(end)
        self._ids[self._size : end] = ids
        self._logprobs[self._size : end] = 0.0
        self._mask[self._size : end] = 0
        self._size = end

    def append_sampled(self, ids: IdArray, logprobs: LogprobArray) -> None:
        """Tokens the model sampled: mask 1 with their logprobs."""
        if len(ids) != len(logprobs):
            raise ValueError("ids and logprobs differ in length")
        end = self._size + len(ids)
        self._reserve(end)
        self._ids[self._size : end] = ids
        self._logprobs[self._size : end] = logprobs
        self._mask[self._size : end] = 1
        self._size = end

    def truncate(self, size: int) -> None:
        if not 0 <= size <= self._size:
            raise ValueError(f"cannot truncate {self._size} tokens to {size}")
        self._size = size

    # Views share memory with the buffer: valid until the next mutation.
    @property
    def ids(self) -> IdArray:
        return self._ids[: self._size]

    @property
    def logprobs(self) -> LogprobArray:
        return self._logprobs[: self._size]

    @property
    def mask(self) -> MaskArray:
        return self._mask[: self._size]


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
    weight_version: str | None
    cached_tokens: int | None
    upstream_latency_s: float
    created_at: float


class Trajectory:
    """Token sequence and turn records of one session."""

    __slots__ = ("experts", "experts_width", "tokens", "turns")

    def __init__(self) -> None:
        self.tokens = TokenBuffer()
        self.turns: list[Turn] = []
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
        return self.tokens.ids[turn.completion_start : turn.completion_end]

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
        self.tokens.truncate(self.length_after(keep_turns))
        self.tokens.append_prompt(prompt_ids)
        self.tokens.append_sampled(sampled_ids, sampled_logprobs)
        self.turns.append(turn)
        if experts is not None:
            self.experts += experts
            self.experts_width = experts_width

    def check(self) -> str | None:
        """Return a description of the first broken invariant, or None."""
        tokens = self.tokens
        if not len(tokens.ids) == len(tokens.logprobs) == len(tokens.mask):
            return "token arrays differ in length"
        position = 0
        for i, turn in enumerate(self.turns):
            if turn.index != i:
                return f"turn {i} has index {turn.index}"
            if not position == turn.prompt_start <= turn.completion_start <= turn.completion_end:
                return f"turn {i} span does not tile the sequence"
            position = turn.completion_end
        if position != len(tokens):
            return f"turns cover {position} tokens but the sequence has {len(tokens)}"
        return None
