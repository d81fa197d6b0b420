"""First prompts from a shared-prefix cache: the ids of a rendered head that
many sessions share, tokenised once.

In RL thousands of episodes open with the same system prompt and tool list;
rendering them is cheap, tokenising them is most of a first turn's cost. A
first turn's prompt is ``encode(prefix) + encode(rest)`` when ``prefix`` ends
right after a special token across which the tokenizer cannot merge: HF
tokenizers cut their input at added tokens before the model sees it, so the
two sides are tokenised apart anyway. Which special tokens allow that is
probed per token the first time a head ends with it (`PrefixCache._safe`):
an added token that strips whitespace to its right or starts a longer added
token is never a cut, and a pre-tokenizer that marks the start of a text
(SentencePiece's ``▁`` prepended to the first piece) fails the probe.

Exactness does not depend on the head: an entry is used only when the new
prompt starts with its prefix, and the ids are then those of a full
tokenisation by the property above. The head only says where a shared part
is likely to end: the request's leading system/developer messages rendered
alone, with the same template, tools and kwargs (the key, compared whole, so
different tools or kwargs can never hit). A template that renders them
differently when more follows simply gets no entry. Every
``verify_every``-th hit is tokenised whole as well; a difference is logged
as an error, the cache turned off and the full ids used
(docs/architecture.md#shared-prefix-cache).
"""

from __future__ import annotations

import itertools
import logging
import re
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from .bounded import encode_within

__all__ = ["PrefixCache"]

logger = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]

# Texts placed after a candidate cut in the probe: every way the
# rest of a prompt may begin (a word, spaces, newlines, digits, CJK, a
# special token).
_PROBE_RESTS: Final = ("a", " a", "\n\nb", "  x", "1", "日本", "\t", " ")
_PROBE_HEADS: Final = ("x", "Hi.\n")
# Distinct heads kept; a server sees a handful of system prompts and tool
# lists, the bound stops a hostile mix.
_ENTRIES: Final = 64
# A head shorter than this is tokenised with the rest: nothing worth caching.
_MIN_PREFIX_CHARS: Final = 256
# A longer prefix is used for its request but not kept: the cache's memory
# stays bounded (entries × this × 4 bytes) whatever agents send.
_MAX_PREFIX_TOKENS: Final = 1 << 16


@dataclass(frozen=True, slots=True)
class _Entry:
    prefix: str  # ends right after a safe special token
    ids: array[int]  # its whole tokenisation (int32: 4 bytes an id)


_MISSING: Final = _Entry("", array("i"))


class PrefixCache:
    """Prefix ids by key; see the module docstring for when they are exact.

    `added`: the tokenizer's added tokens as (content, special, rstrip)."""

    def __init__(
        self, encode: Encode, added: Iterable[tuple[str, bool, bool]], verify_every: int = 64
    ) -> None:
        self._encode = encode
        tokens = [(content, special, rstrip) for content, special, rstrip in added if content]
        contents = sorted({content for content, _, _ in tokens})
        # A token that begins a longer one is no end: after it the longer
        # one may match across the cut. (Sorted, the strings a token begins
        # follow it at once.)
        extended = {c for c, after in itertools.pairwise(contents) if after.startswith(c)}
        self._candidates = frozenset(
            c for c, special, rstrip in tokens if special and not rstrip and c not in extended
        )
        self._others = tuple(sorted(self._candidates)[:4])  # special starts of a rest
        # Where the tokenizer finds added tokens: leftmost, longest first.
        by_length = sorted(contents, key=len, reverse=True)
        self._scan = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        # Probed candidates: whether a cut after one keeps the ids exact.
        self._verdicts: dict[str, bool] = {}
        # key -> entry (None: the key's head gives no usable prefix). Single
        # dict operations (atomic under the GIL): a first turn may be planned
        # on a worker thread; a full cache simply starts over.
        self._entries: dict[bytes, _Entry | None] = {}
        self._verify_every = verify_every
        self.hits = 0
        self.enabled = bool(self._candidates)

    def _safe(self, content: str) -> bool:
        """Whether a text cut right after `content` tokenises, side by side,
        into the ids of the whole (probed once per token)."""
        verdict = self._verdicts.get(content)
        if verdict is None:
            encode = self._encode
            verdict = all(
                encode(head + content + rest) == encode(head + content) + encode(rest)
                for head in _PROBE_HEADS
                for rest in (*_PROBE_RESTS, *(o + "y" for o in self._others))
            )
            self._verdicts[content] = verdict
        return verdict

    def _prefix(self, head: str) -> str:
        """`head` up to the end of its last added token that is a safe cut."""
        if self._scan is None:
            return ""
        for match in reversed(list(self._scan.finditer(head))):
            if match.group() in self._candidates and self._safe(match.group()):
                return head[: match.end()]
        return ""

    def lookup(
        self, key: bytes, text: str, head: Callable[[], str | None], most: int | None = None
    ) -> tuple[str, list[int]] | None:
        """The prefix of `key` that starts `text`, and its ids; on a miss
        made from `head()` (the shared part rendered alone, None when it
        cannot be), tokenised within `most` (`PromptTooLong` past it)."""
        if not self.enabled:
            return None
        entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            entry = self._make(head(), most)
            if entry is None or len(entry.ids) <= _MAX_PREFIX_TOKENS:  # else used once
                if len(self._entries) >= _ENTRIES:
                    self._entries.clear()
                self._entries[key] = entry
        if entry is None or not text.startswith(entry.prefix):
            return None
        return entry.prefix, entry.ids.tolist()

    def _make(self, head: str | None, most: int | None) -> _Entry | None:
        if head is None:
            return None
        prefix = self._prefix(head)
        if len(prefix) < _MIN_PREFIX_CHARS:
            return None
        return _Entry(prefix, array("i", encode_within(self._encode, prefix, most)))

    def checked(self, text: str, ids: list[int]) -> list[int]:
        """`ids`, made from a hit for `text`; every `verify_every`-th hit
        compared with a whole tokenisation (the whole one wins, loudly)."""
        self.hits += 1
        if self.hits % self._verify_every:
            return ids
        whole = self._encode(text)
        if whole != ids:
            self.enabled = False
            self._entries.clear()
            logger.error(
                "shared-prefix cache: a prompt's ids differ from its whole tokenisation "
                "(%d vs %d ids); the cache is off from now on, the whole ids are used",
                len(ids),
                len(whole),
            )
        return whole
