"""The emulator's model of SGLang's prefix (radix) KV cache.

Granularity is a block of ``block_tokens`` tokens (default 16, like a paged
KV cache): a prompt's cached prefix is the run of its leading *full* blocks
that are cached, so ``cached_tokens`` is a multiple of the block size. Each
block is keyed by a hash chained over all tokens before it, so a block only
matches when the whole prefix up to it matches. Like SGLang, the last prompt
token is never counted as cached (its logits must be computed).

Capacity is in tokens (whole blocks); eviction is LRU, and every lookup or
insert refreshes a chain from its deepest block to its root so that leaves are
evicted before the prefixes they extend. Blocks inserted by a request that
carries a session id are owned by that session; closing the session frees the
blocks no other session (and no anonymous request) also inserted.

KV held outside the cache (streaming sessions' slots, `reserve`) shares the
pool: the cache keeps at most capacity minus the held tokens, evicting LRU
blocks when the held amount grows. Held KV is never evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PrefixCache"]


@dataclass
class _Block:
    owners: set[str] = field(default_factory=set)
    anonymous: bool = False


class PrefixCache:
    """LRU set of token-prefix blocks; capacity 0 disables caching."""

    def __init__(self, capacity_tokens: int, block_tokens: int = 16) -> None:
        if capacity_tokens < 0 or block_tokens < 1:
            raise ValueError("capacity_tokens must be >= 0 and block_tokens >= 1")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self.reserved_tokens = 0
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._by_session: dict[str, set[bytes]] = {}

    @property
    def used_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    @property
    def _room_blocks(self) -> int:
        return max(0, self.capacity_blocks - -(-self.reserved_tokens // self.block_tokens))

    def reserve(self, tokens: int) -> None:
        """Set the KV held outside the cache; evicts LRU blocks down to what is left."""
        self.reserved_tokens = tokens
        self._evict()

    def _evict(self) -> None:
        while len(self._blocks) > self._room_blocks:
            key, block = self._blocks.popitem(last=False)
            self._forget(key, block)

    def session_tokens(self, session_id: str) -> int:
        """Tokens held by blocks the session inserted."""
        return len(self._by_session.get(session_id, ())) * self.block_tokens

    def _keys(self, ids: Sequence[int]) -> list[bytes]:
        arr = np.asarray(ids, dtype=np.int64)
        keys: list[bytes] = []
        parent = b""
        for start in range(0, len(arr) - self.block_tokens + 1, self.block_tokens):
            parent = hashlib.blake2b(
                parent + arr[start : start + self.block_tokens].tobytes(), digest_size=16
            ).digest()
            keys.append(parent)
        return keys

    def _refresh(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def match(self, prompt_ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of the prompt (and refresh it)."""
        hits: list[bytes] = []
        for key in self._keys(prompt_ids[:-1]):
            if key not in self._blocks:
                break
            hits.append(key)
        self._refresh(hits)
        return len(hits) * self.block_tokens

    def insert(self, ids: Sequence[int], session_id: str | None = None) -> None:
        """Cache every full block of ``ids`` (prompt + completion), evicting LRU blocks."""
        room = self._room_blocks
        if room == 0:
            return
        # A block is useless without its ancestors: keep the head of a long sequence.
        keys = self._keys(ids)[:room]
        for key in keys:
            block = self._blocks.setdefault(key, _Block())
            if session_id is None:
                block.anonymous = True
            else:
                block.owners.add(session_id)
                self._by_session.setdefault(session_id, set()).add(key)
        self._refresh(keys)
        self._evict()

    def release_session(self, session_id: str) -> int:
        """Drop the session's blocks that nobody else holds; returns tokens freed."""
        freed = 0
        for key in self._by_session.pop(session_id, set()):
            block = self._blocks[key]  # evicted blocks already left the session's set
            block.owners.discard(session_id)
            if not block.owners and not block.anonymous:
                del self._blocks[key]
                freed += self.block_tokens
        return freed

    def _forget(self, key: bytes, block: _Block) -> None:
        for owner in block.owners:
            keys = self._by_session.get(owner)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_session[owner]
