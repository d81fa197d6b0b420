"""The emulator's model of SGLang's prefix (radix) KV cache.

Granularity is a block of ``block_tokens`` tokens (default 16, like a paged
KV cache): a prompt's cached prefix is the run of its leading *full* blocks
that are cached, so ``cached_tokens`` is a multiple of the block size. Each
block is keyed by a hash chained over all tokens before it, so a block only
matches when the whole prefix up to it matches. Like SGLang, the last prompt
token is never counted as cached (its logits must be computed).

Capacity is in tokens (whole blocks). Every lookup or insert refreshes a chain
from its deepest block to its root, so a block is always less recently used
than its ancestors and eviction takes leaves before the prefixes they extend.

Session references (SGLang 0.5.23's ``--enable-session-radix-cache``,
``mem_cache/unified_cache/session_ref_tracker.py`` and
``components/{base,full}.py``), off by default as in SGLang:

- a request carrying a session id takes the session's *generation* when it
  arrives (``ensure_session_generation``); when it finishes, the deepest
  block of what it inserted (prompt + completion) becomes one of the
  session's leaves, unless the session was closed or reopened meanwhile;
- every block on the path from a session leaf to the root holds one
  reference per leaf. A new leaf that extends one of the session's leaves
  replaces it (the reference moves forward: ``_advance_session_coverage``);
  one that does not (a branch, a shorter retry) is added beside it;
- eviction takes the block with the lowest (referenced, references, LRU)
  key: unreferenced blocks first, then fewer references, then the least
  recently used (``FullComponent._session_ref_eviction_strategy``). An
  evicted session leaf hands the session's reference to its parent
  (``discard_deleted_session_leaf``);
- closing a session only drops its references (the blocks stay cached, now
  evicted first) and tombstones the id so that a request still in flight
  does not reference it again; a later request with the id starts a new
  generation. Without the flag session ids change nothing.

KV held outside the cache (streaming sessions' slots, `reserve`) shares the
pool: the cache keeps at most capacity minus the held tokens, evicting blocks
when the held amount grows. Held KV is never evicted.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PrefixCache", "SessionRef"]

# SGLang's _CLOSED_SESSION_TOMBSTONE_LIMIT: closed ids remembered against late finishes.
_TOMBSTONE_LIMIT = 8192

# (session id, generation): what a request took when it arrived.
SessionRef = tuple[str, int]


@dataclass(slots=True)
class _Block:
    parent: bytes | None  # the block before it (None: the first block of a prompt)
    stamp: int  # last use; a block's ancestors always have larger stamps
    refs: int = 0  # session leaves whose path to the root runs through this block
    leaf_of: set[str] | None = None  # sessions for which this block is a leaf


class PrefixCache:
    """Set of token-prefix blocks; capacity 0 disables caching.

    ``session_refs``: SGLang's ``--enable-session-radix-cache``.
    """

    def __init__(
        self, capacity_tokens: int, block_tokens: int = 16, *, session_refs: bool = False
    ) -> None:
        if capacity_tokens < 0 or block_tokens < 1:
            raise ValueError("capacity_tokens must be >= 0 and block_tokens >= 1")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self.session_refs = session_refs
        self.reserved_tokens = 0
        self._blocks: dict[bytes, _Block] = {}
        self._clock = itertools.count()
        # Eviction candidates keyed like SGLang's heap; stale entries (the block
        # changed or left since) are skipped when popped.
        self._heap: list[tuple[bool, int, int, bytes]] = []
        self._leaves: dict[str, set[bytes]] = {}
        self._generations: dict[str, int] = {}
        self._incarnations = 0
        self._closed: OrderedDict[str, None] = OrderedDict()

    # -- capacity ------------------------------------------------------------

    @property
    def used_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    @property
    def referenced_tokens(self) -> int:
        """Cached tokens some session references."""
        return sum(1 for b in self._blocks.values() if b.refs) * self.block_tokens

    @property
    def _room_blocks(self) -> int:
        return max(0, self.capacity_blocks - -(-self.reserved_tokens // self.block_tokens))

    def reserve(self, tokens: int) -> None:
        """Set the KV held outside the cache; evicts blocks down to what is left."""
        self.reserved_tokens = tokens
        self._evict()

    def _push(self, key: bytes, block: _Block) -> None:
        heapq.heappush(self._heap, (block.refs > 0, block.refs, block.stamp, key))

    def _evict(self) -> None:
        while len(self._blocks) > self._room_blocks:
            _, refs, stamp, key = heapq.heappop(self._heap)
            block = self._blocks.get(key)
            if block is None or block.refs != refs or block.stamp != stamp:
                continue
            # The lowest key is a leaf: its ancestors are newer with as many refs.
            del self._blocks[key]
            for session_id in tuple(block.leaf_of or ()):
                self._discard_leaf(session_id, key, block)
        if len(self._heap) > 4 * len(self._blocks) + 64:
            self._heap = [(b.refs > 0, b.refs, b.stamp, k) for k, b in self._blocks.items()]
            heapq.heapify(self._heap)

    # -- lookups -------------------------------------------------------------

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
            block = self._blocks[key]
            block.stamp = next(self._clock)
            self._push(key, block)

    def match(self, prompt_ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of the prompt (and refresh it)."""
        hits: list[bytes] = []
        for key in self._keys(prompt_ids[:-1]):
            if key not in self._blocks:
                break
            hits.append(key)
        self._refresh(hits)
        return len(hits) * self.block_tokens

    def insert(self, ids: Sequence[int], session: SessionRef | None = None) -> None:
        """Cache every full block of ``ids``, then evict down to capacity.

        ``session``: the finished request's session and generation; the
        deepest inserted block becomes the session's leaf (before evicting,
        as SGLang registers at finish and evicts at the next allocation).
        """
        room = self._room_blocks
        if room == 0:
            return
        # A block is useless without its ancestors: keep the head of a long sequence.
        keys = self._keys(ids)[:room]
        parent: bytes | None = None
        for key in keys:
            if key not in self._blocks:
                self._blocks[key] = _Block(parent, 0)
            parent = key
        self._refresh(keys)
        if keys and session is not None:
            self._register(session, keys[-1])
        self._evict()

    # -- session references -------------------------------------------------

    def session_ref(self, session_id: str | None) -> SessionRef | None:
        """What a request with ``session_id`` takes on arrival (None: no references)."""
        if not self.session_refs or session_id is None:
            return None
        generation = self._generations.get(session_id)
        if generation is None:
            generation = self.open_session(session_id)
        return session_id, generation

    def open_session(self, session_id: str) -> int:
        """``open_radix_session``: a new generation; forgets a close of the id."""
        self._closed.pop(session_id, None)
        self._incarnations += 1
        self._generations[session_id] = self._incarnations
        return self._incarnations

    def release_session(self, session_id: str) -> None:
        """``release_radix_session``: drop the session's references, free nothing."""
        if not self.session_refs or session_id in self._closed:
            return
        self._closed[session_id] = None
        while len(self._closed) > _TOMBSTONE_LIMIT:
            self._closed.popitem(last=False)
        self._generations.pop(session_id, None)
        for leaf in tuple(self._leaves.get(session_id, ())):
            self._add_refs(leaf, None, -1)
            self._unmark(session_id, leaf)

    def session_tokens(self, session_id: str) -> int:
        """Tokens on the paths from the session's leaves to the root."""
        keys: set[bytes] = set()
        for leaf in self._leaves.get(session_id, ()):
            key: bytes | None = leaf
            while key is not None and key not in keys:
                keys.add(key)
                key = self._blocks[key].parent
        return len(keys) * self.block_tokens

    def refs(self, ids: Sequence[int]) -> list[int]:
        """Session references of each cached full block of ``ids`` (a test's view)."""
        return [self._blocks[k].refs for k in self._keys(ids) if k in self._blocks]

    def _register(self, session: SessionRef, leaf: bytes) -> None:
        """``register_session_ref`` + ``register_session_leaf``."""
        session_id, generation = session
        if session_id in self._closed or self._generations.get(session_id) != generation:
            return  # closed, or reopened since the request arrived: stale
        leaves = self._leaves.setdefault(session_id, set())
        if leaf in leaves:
            return
        ancestor = self._blocks[leaf].parent
        while ancestor is not None and ancestor not in leaves:
            ancestor = self._blocks[ancestor].parent
        self._add_refs(leaf, ancestor, +1)
        self._mark(session_id, leaf)
        if ancestor is not None:
            self._unmark(session_id, ancestor)

    def _discard_leaf(self, session_id: str, key: bytes, block: _Block) -> None:
        """``discard_deleted_session_leaf``: the evicted leaf's reference recedes."""
        self._unmark(session_id, key, block)
        parent = block.parent
        if parent is None:
            return
        if parent in self._leaves.get(session_id, ()):
            self._add_refs(parent, None, -1)  # the parent holds its own reference
        else:
            self._mark(session_id, parent)

    def _add_refs(self, leaf: bytes, stop: bytes | None, delta: int) -> None:
        key: bytes | None = leaf
        while key is not None and key != stop:
            block = self._blocks[key]
            block.refs += delta
            assert block.refs >= 0
            self._push(key, block)
            key = block.parent

    def _mark(self, session_id: str, key: bytes) -> None:
        self._leaves.setdefault(session_id, set()).add(key)
        block = self._blocks[key]
        if block.leaf_of is None:
            block.leaf_of = set()
        block.leaf_of.add(session_id)

    def _unmark(self, session_id: str, key: bytes, block: _Block | None = None) -> None:
        leaves = self._leaves[session_id]
        leaves.discard(key)
        if not leaves:
            del self._leaves[session_id]
        block = block or self._blocks[key]
        assert block.leaf_of is not None
        block.leaf_of.discard(session_id)
        if not block.leaf_of:
            block.leaf_of = None
