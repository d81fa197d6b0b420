"""Tokenising a text that may not fit: refused for about what reading it costs.

A prompt that cannot fit the model's context is refused (400
``context_length_exceeded``), but tokenising a 10 MB text whole to learn that
costs seconds of CPU and a gigabyte of token arrays. `encode_within` first
counts the text's tokens piece by piece and stops once they cannot fit: the
work is bounded by the room, not by the text.

The count is a lower bound, so a refusal is never wrong: pieces are cut
where a word ends (before a space or newline), and tokenising two pieces
apart can add tokens only next to the cut — a pre-tokenizer rule that
attaches the whitespace to what precedes it, a SentencePiece ``▁`` prefixed
to the second piece — never remove one the whole text would not have; each
cut is allowed `CUT_ALLOWANCE` extra tokens (checked over every family's
tokenizer and adversarial cuts: tests/unit/prompt/test_bounded.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Final

__all__ = ["CUT_ALLOWANCE", "PromptTooLong", "encode_within", "tokens_at_least"]

# Characters per counted piece: small enough that counting stops soon after
# the room is used up, large enough that cuts (and their allowance) are few.
PIECE_CHARS: Final = 1 << 16
# Tokens a cut may add to the pieces' count over the whole text's.
CUT_ALLOWANCE: Final = 8

Encode = Callable[[str], list[int]]


class PromptTooLong(Exception):
    """The text holds more tokens than the room it was given; the caller
    knows which limit that is and refuses the request."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


def _cut(text: str, start: int) -> int:
    """Where the piece starting at `start` ends: before the last space or
    newline in its second half, else at its full length."""
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    low = start + PIECE_CHARS // 2
    at = max(text.rfind(" ", low, end), text.rfind("\n", low, end))
    return at if at > low else end


def _utf8_length(text: str) -> int:
    """Its UTF-8 length, without encoding an ASCII text (the usual one)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8"))


def tokens_at_least(encode: Encode, text: str, most: int) -> int:
    """A lower bound on the tokens of `text`, counted until it exceeds
    `most` (then it is returned at once) or the text ends."""
    counted = start = bound = 0
    for cuts in itertools.count():  # cuts made so far: one fewer than pieces
        end = _cut(text, start)
        counted += len(encode(text[start:end]))
        bound = max(counted - cuts * CUT_ALLOWANCE, 0)
        if bound > most or end == len(text):
            break
        start = end
    return bound


def encode_within(encode: Encode, text: str, most: int | None) -> list[int]:
    """``encode(text)``, or `PromptTooLong` when the text holds more than
    `most` tokens (None: no bound). A text of at most `most` UTF-8 bytes
    cannot (no token is shorter than a byte, bar a SentencePiece prefix),
    so only a longer one is counted first: the text tokenised twice when it
    fits after all, once up to the room when it does not."""
    if most is None or _utf8_length(text) < most:
        return encode(text)
    at_least = tokens_at_least(encode, text, most)
    if at_least > most:
        raise PromptTooLong(at_least)
    return encode(text)
