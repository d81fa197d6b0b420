"""A session's stored conversation, kept compact: one flat record per message.

Keeping the conversation as the normalised message dicts costs well over
its JSON size and several GC-tracked objects per message (dicts, lists of
tool calls, their nested dicts), which every full collection walks, for
every session (docs/performance.md#compact-conversation-records). A
`Record` is a plain tuple of
strings, bytes and None, so the collector untracks it (and the tuple of
records) after one pass, and the texts are stored once:

- ``role``      interned;
- ``content``   the message's content string, or None;
- ``reasoning`` its ``reasoning_content`` string, or None;
- ``calls``     the history-matching key of its tool calls: canonical JSON
  (sorted keys) of ``[[name, arguments], …]``, or None when it has none;
- ``rest``      the message as JSON with ``content`` and ``reasoning_content``
  nulled (their strings are the fields above): everything else, in the
  message's own key order, so `messages` rebuilds dicts equal to the stored
  ones, keys in the same order (export and the journal are byte-identical).

History matching (`common_prefix`) compares records with incoming messages
without rebuilding dicts: exactly the rules of `messages.common_prefix`
(tested against it). Tool-call keys compare as bytes first; canonical bytes
that differ can still be Python-equal (``1`` vs ``1.0``), so a mismatch is
decided by the original rule on the decoded key — once per request at most,
since matching stops at the first difference. Nothing here re-parses the
stored conversation per turn.

A `Conversation` is immutable: commits build a new one, so holding a
reference is a snapshot (export relies on it).

It also knows the bytes its texts take (`text_bytes`: each string and bytes
object a record keeps, as `sys.getsizeof` counts it), kept up to date in
O(new) by each splice: what a session's byte budget counts of its messages,
rendered or not (docs/reliability.md#what-a-session-keeps).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from ..prompt.messages import Message

__all__ = ["Conversation", "Record", "encode", "record_bytes"]

_CONTENT = "content"
_REASONING = "reasoning_content"


# (role, content, reasoning, calls, rest). A plain tuple, not a NamedTuple:
# the collector untracks only exact tuples (NamedTuple records stay tracked).
Record = tuple[str, str | None, str | None, bytes | None, bytes]


def _calls_key(calls: Any) -> list[list[Any]]:
    return [[c["function"]["name"], c["function"]["arguments"]] for c in calls]


def _kept(data: bytes) -> bytes:
    """A stored copy of orjson output: orjson returns its bytes inside an
    allocation of several KiB, whatever their length, so anything kept is
    copied to an exact-size object."""
    return bytes(memoryview(data))


def _calls_bytes(message: Message) -> bytes | None:
    calls = message.get("tool_calls")
    if not calls:
        return None
    return orjson.dumps(_calls_key(calls), option=orjson.OPT_SORT_KEYS)


def _record(message: Message) -> Record:
    content = message.get(_CONTENT)
    reasoning = message.get(_REASONING)
    # Only strings move out of `rest` (a non-string stays where it is).
    content = content if isinstance(content, str) else None
    reasoning = reasoning if isinstance(reasoning, str) else None
    rest = message
    if content is not None or reasoning is not None:
        rest = dict(message)
        if content is not None:
            rest[_CONTENT] = None
        if reasoning is not None:
            rest[_REASONING] = None
    calls = _calls_bytes(message)
    return (
        sys.intern(message["role"]),
        content,
        reasoning,
        None if calls is None else _kept(calls),
        _kept(orjson.dumps(rest)),
    )


def encode(messages: Iterable[Message]) -> tuple[Record, ...]:
    """The records `messages` would be stored as (a splice takes them as they are)."""
    return tuple(_record(m) for m in messages)


def record_bytes(records: Iterable[Record]) -> int:
    """The bytes the records' texts take: every string and bytes object they
    keep (`sys.getsizeof`: the text plus about 50 bytes of header each)."""
    size = 0
    for _, content, reasoning, calls, rest in records:
        size += sys.getsizeof(rest)
        if content is not None:
            size += sys.getsizeof(content)
        if reasoning is not None:
            size += sys.getsizeof(reasoning)
        if calls is not None:
            size += sys.getsizeof(calls)
    return size


def _message(record: Record) -> Message:
    _, content, reasoning, _, rest = record
    message: Message = orjson.loads(rest)
    # Assigning an existing key keeps its position: the original key order.
    if content is not None:
        message[_CONTENT] = content
    if reasoning is not None:
        message[_REASONING] = reasoning
    return message


def _same(record: Record, incoming: Message) -> bool:
    """`messages._same(stored, incoming)` with `stored` given as its record."""
    role, content, reasoning, calls, _ = record
    if role != incoming["role"]:
        return False
    if (content or "") != (incoming["content"] or ""):
        return False
    theirs_calls = _calls_bytes(incoming)
    if calls != theirs_calls:
        if calls is None or theirs_calls is None:
            return False
        # Different bytes, maybe equal values (1 vs 1.0): the original rule.
        if orjson.loads(calls) != _calls_key(incoming["tool_calls"]):
            return False
    theirs = incoming.get(_REASONING)
    return theirs is None or (reasoning or "") == theirs


class Conversation:
    """The stored messages of a session, as records."""

    __slots__ = ("_bytes", "_records")

    def __init__(self, messages: Iterable[Message] = ()) -> None:
        self._records: tuple[Record, ...] = encode(messages)
        self._bytes = record_bytes(self._records)

    @classmethod
    def _of(cls, records: tuple[Record, ...], nbytes: int) -> Conversation:
        new = cls()
        new._records = records
        new._bytes = nbytes
        return new

    def __len__(self) -> int:
        return len(self._records)

    @property
    def records(self) -> tuple[Record, ...]:
        return self._records

    def messages(self, start: int = 0) -> list[Message]:
        """The stored messages from `start` on, as fresh dicts."""
        return [_message(r) for r in self._records[start:]]

    def message(self, index: int) -> Message:
        """One stored message, as a fresh dict."""
        return _message(self._records[index])

    @property
    def text_bytes(self) -> int:
        """The bytes the stored texts take (`record_bytes` of every record)."""
        return self._bytes

    def spliced(
        self, keep: int, new: Iterable[Message] = (), *, encoded: tuple[Record, ...] = ()
    ) -> Conversation:
        """The first `keep` messages followed by the records `encoded` (as
        `encode` made them: a turn's plan measured them already), then `new`
        (encoded once, here)."""
        records = encoded + encode(new)
        return self._of(self._records[:keep] + records, self.bytes_after(keep, records))

    def bytes_after(self, keep: int, records: tuple[Record, ...]) -> int:
        """`text_bytes` of the first `keep` messages followed by `records`:
        O(the records dropped and added), not O(the conversation)."""
        return self._bytes - record_bytes(self._records[keep:]) + record_bytes(records)

    def common_prefix(self, incoming: Sequence[Message]) -> int:
        """Number of leading messages shared with `incoming` (docs/api.md#history-rules)."""
        n = 0
        for record, message in zip(self._records, incoming, strict=False):
            # Inline, what most messages are: the same role and content
            # objects' equality, no tool calls on either side, no reasoning
            # sent; `_same` would call them the same, and decides the rest.
            if (
                record[1] != message[_CONTENT]
                or record[3] is not None
                or record[0] != message["role"]
                or message.get("tool_calls")
                or message.get(_REASONING) is not None
            ) and not _same(record, message):
                break
            n += 1
        return n

    @property
    def nbytes(self) -> int:
        """Bytes held by the records (for the memory benchmark)."""
        size = sys.getsizeof(self._records)
        for record in self._records:
            size += sys.getsizeof(record)
            for part in record[1:]:
                if part is not None:
                    size += sys.getsizeof(part)
        return size
