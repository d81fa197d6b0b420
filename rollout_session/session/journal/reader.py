"""Reading a journal segment back: streamed, resynchronising after damage.

Owns replay's side of the bytes (`format` owns their framing):
`replay_segment` hands each record of a segment over in order, reading it a
window at a time through positional reads, so memory is one window (or the
largest record) whatever the segment's size; records are views into their
window until replay copies what it keeps.

A frame whose header, length, magic or crc is wrong is not trusted, and
neither is its length: reading resynchronises on the next offset where the
magic (``{"t":"`` at byte 12 of every frame) starts a frame that checks out
in full (length within the segment, crc, decodable meta). The damaged bytes
in between cost only the records they hold: they are kept aside as
``….log.bad-OFFSET`` for a post-mortem, logged at ERROR with the ids of the
sessions still legible in them, and handed to the caller, which drops those
sessions. Damage at the end of a segment (a torn tail: a write cut short by
a crash) is cut off and logged at WARNING.
"""

from __future__ import annotations

import logging
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from .format import HEADER, MAGIC, META, MIN_BODY, PREFIX, VERSION, JournalError

__all__ = ["READ_BYTES", "Damage", "Record", "replay_segment", "scan"]

# The journal's one logger, whichever of its modules speaks.
logger = logging.getLogger("rollout_session.journal")

# Replay reads segments in windows of this size (a larger record, whole).
READ_BYTES = 1 << 20
# A body over this is crc-checked as it streams by before it is held whole.
_VERIFY_BYTES = 64 << 20
# How a legible meta names its session (session ids need no JSON escapes).
_ID = re.compile(rb'\{"t":"[a-z]{1,16}","id":"([A-Za-z0-9._:-]{1,128})"')
_ID_WINDOW = len(b'{"t":"","id":""') + 16 + 128


@dataclass(slots=True)
class Record:
    offset: int
    size: int  # framed size on disk
    meta: dict[str, Any]
    blobs: list[memoryview]


@dataclass(frozen=True, slots=True)
class Damage:
    """Bytes of a segment that hold no readable record: from a refused frame
    to the next frame that checks out (or the end of the segment)."""

    start: int
    end: int
    reason: str  # why the frame at `start` was refused
    # Session ids still legible in the damaged bytes (the metas of the records
    # they held, when those survived): the sessions the damage is known to cost.
    session_ids: tuple[str, ...]

    @property
    def torn(self) -> bool:
        """A frame cut short by the end of the segment with nothing readable
        after it: what a crash mid-write leaves."""
        return self.reason.startswith("torn")


class _Source:
    """Positional reads of a segment (or of bytes, for `scan`) through one
    window: memory is one window, at least `chunk` bytes and as large as the
    largest record read, however large the segment."""

    def __init__(self, read: Callable[[int, int], bytes], size: int, chunk: int) -> None:
        self._read = read
        self.size = size
        self._chunk = chunk
        self._data = b""
        self._base = 0

    @classmethod
    def of_bytes(cls, data: bytes) -> _Source:
        source = cls(lambda offset, n: data[offset : offset + n], len(data), len(data))
        source._data = data  # the whole of it: never read again
        return source

    def get(self, offset: int, n: int) -> memoryview | None:
        """Bytes [offset, offset + n), or None past the end."""
        if offset < 0 or offset + n > self.size:
            return None
        lo = offset - self._base
        if lo < 0 or lo + n > len(self._data):
            # A new window from `offset`: views of the old one stay valid
            # (bytes are immutable) for as long as records hold them.
            self._data = self._read(offset, min(max(n, self._chunk), self.size - offset))
            self._base, lo = offset, 0
        return memoryview(self._data)[lo : lo + n]

    def crc(self, offset: int, n: int) -> int:
        """crc32 of bytes [offset, offset + n), read a window at a time and not kept."""
        crc, end = 0, offset + n
        while offset < end:
            step = min(self._chunk, end - offset)
            crc = zlib.crc32(self._read(offset, step), crc)
            offset += step
        return crc

    def find(self, pattern: bytes, offset: int) -> int:
        """The first offset at or after `offset` where `pattern` starts, or -1."""
        while offset + len(pattern) <= self.size:
            self.get(offset, min(self.size - offset, max(self._chunk, len(pattern))))
            hit = self._data.find(pattern, offset - self._base)
            if hit >= 0:
                return self._base + hit
            offset = self._base + len(self._data) - len(pattern) + 1
        return -1


def _frame(source: _Source, pos: int) -> tuple[Record | None, str]:
    """The record framed at `pos`, or (None, why not)."""
    head = source.get(pos, PREFIX + len(MAGIC))
    if head is None:
        return None, "torn record header" if source.size - pos < HEADER.size else "torn record"
    size, crc = HEADER.unpack_from(head)
    end = pos + HEADER.size + size
    if size < MIN_BODY:
        return None, f"impossible record length {size}"
    if end > source.size:
        return None, "torn record"
    if head[PREFIX:] != MAGIC:
        return None, "not a record (no type at the start of its meta)"
    # A body too large to hold on a guess (a corrupt length can claim most of
    # the segment) is checked as it streams by, and held only once it is good.
    if size > _VERIFY_BYTES and source.crc(pos + HEADER.size, size) != crc:
        return None, "crc mismatch"
    body = source.get(pos + HEADER.size, size)
    assert body is not None  # within the segment: checked above
    if size <= _VERIFY_BYTES and zlib.crc32(body) != crc:
        return None, "crc mismatch"
    try:
        meta, blobs = _split(body)
    except (ValueError, TypeError) as exc:
        return None, f"undecodable record ({exc})"
    return Record(pos, end - pos, meta, blobs), ""


def _resync(source: _Source, start: int) -> int:
    """The offset of the first frame at or after `start` that checks out
    (length within the segment, type magic, crc, decodable meta), or the end
    of the segment. Only the magic's offsets are tried: every record's meta
    begins with it, and in a JSON string it would be escaped."""
    at = start + PREFIX
    while (hit := source.find(MAGIC, at)) >= 0:
        candidate = hit - PREFIX
        if _frame(source, candidate)[0] is not None:
            return candidate
        at = hit + 1
    return source.size


def _legible_ids(source: _Source, start: int, end: int) -> tuple[str, ...]:
    """Session ids of the record metas still legible in [start, end)."""
    ids: dict[str, None] = {}
    at = start
    while 0 <= (hit := source.find(MAGIC, at)) < end:
        head = source.get(hit, min(_ID_WINDOW, source.size - hit))
        found = _ID.match(head) if head is not None else None
        if found is not None:
            ids[found.group(1).decode()] = None
        at = hit + 1
    return tuple(ids)


def _read_records(
    source: _Source, on_record: Callable[[Record], None], on_damage: Callable[[Damage], None]
) -> None:
    """Hand over every record in order, and every stretch of damaged bytes
    where it lies: after a refused frame, reading resynchronises on the next
    frame that checks out, so damage costs the records it covers, no more."""
    pos = 0
    while pos < source.size:
        record, why = _frame(source, pos)
        if record is not None:
            on_record(record)
            pos += record.size
            continue
        resume = _resync(source, pos + 1)
        on_damage(Damage(pos, resume, why, _legible_ids(source, pos, resume)))
        pos = resume


def scan(data: bytes, on_record: Callable[[Record], None]) -> tuple[int, str | None]:
    """Decode records of `data` in order until the first refused frame.

    Returns (end offset of the last good record, why scanning stopped early
    or None). For looking at bytes in tests and post-mortems; replay reads
    files with `replay_segment`, which also resynchronises.
    """
    source = _Source.of_bytes(data)
    pos = 0
    while pos < len(data):
        record, why = _frame(source, pos)
        if record is None:
            return pos, why
        on_record(record)
        pos += record.size
    return pos, None


def _pread(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:  # short only at the end of the file, or interrupted
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise JournalError(f"journal segment shrank while it was read (at {offset})")
        data += more
    return data


def replay_segment(
    path: Path,
    number: int,
    on_record: Callable[[Record], None],
    on_damage: Callable[[Damage], None] = lambda damage: None,
) -> tuple[int, bool]:
    """Hand each record after the ``begin`` one to `on_record` (in order), and
    each stretch of damaged bytes to `on_damage` where it lies; cut off a
    torn or damaged tail. Returns (the segment's good size, whether damage
    was found before its end).

    Streams the file: memory is one read window (`READ_BYTES`, or the largest
    record), whatever the segment's size. Damaged bytes are kept aside as
    ``….log.bad-OFFSET`` for a post-mortem. A torn tail (a crash mid-write)
    is logged at WARNING; damage anywhere else at ERROR, with the ids of the
    sessions it is known to cost.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        source = _Source(lambda offset, n: _pread(fd, n, offset), size, READ_BYTES)
        header: list[dict[str, Any]] = []
        damages: list[Damage] = []

        def take(record: Record) -> None:
            if header:
                on_record(record)
                return
            header.append(record.meta)
            if record.meta["t"] != "begin" or record.meta.get("v") != VERSION:
                raise JournalError(f"{path}: not a journal segment of format {VERSION}")

        def hurt(damage: Damage) -> None:
            if not header:
                # Segments only appear by rename once complete: this is not ours.
                raise JournalError(f"{path} does not start with a journal header ({damage.reason})")
            _keep_aside(fd, path, damage)
            damages.append(damage)
            if damage.end < size:  # more records follow: replay must know what it cost
                on_damage(damage)

        _read_records(source, take, hurt)
    finally:
        os.close(fd)
    if not header:
        raise JournalError(f"{path} does not start with a journal header (empty)")
    if header[0].get("seg") != number:
        logger.warning("journal %s: header says segment %s", path, header[0].get("seg"))
    end = size
    for damage in damages:
        dropped = damage.end - damage.start
        if damage.end < size:
            logger.error(
                "journal %s: %s at offset %d: skipped %d bytes to the next good record; "
                "sessions known to be affected: %s",
                path,
                damage.reason,
                damage.start,
                dropped,
                ", ".join(damage.session_ids) or "none legible",
            )
            continue
        end = damage.start
        # Usually a write cut short by a crash (then the record was never
        # acknowledged under --journal-fsync always); a complete record that
        # does not check out is damage proper.
        logger.log(
            logging.WARNING if damage.torn else logging.ERROR,
            "journal %s: %s at offset %d, dropping the last %d bytes (sessions: %s)",
            path,
            damage.reason,
            damage.start,
            dropped,
            ", ".join(damage.session_ids) or "none legible",
        )
        with path.open("r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return end, any(d.end < size for d in damages)


def _keep_aside(fd: int, path: Path, damage: Damage) -> None:
    """Copy the damaged bytes to ``….log.bad-OFFSET``, a window at a time."""
    with path.with_name(f"{path.name}.bad-{damage.start}").open("wb") as out:
        offset = damage.start
        while offset < damage.end:
            step = min(READ_BYTES, damage.end - offset)
            out.write(_pread(fd, step, offset))
            offset += step


def _split(body: memoryview) -> tuple[dict[str, Any], list[memoryview]]:
    (meta_len,) = META.unpack_from(body)
    end = META.size + meta_len
    meta = orjson.loads(body[META.size : end])
    if not isinstance(meta, dict) or not isinstance(meta.get("t"), str):
        raise TypeError("meta is not an object with a type")
    blobs = []
    for n in meta.get("b", []):
        blobs.append(body[end : end + n])
        end += n
    if end != len(body):
        raise ValueError("blob lengths do not add up")
    return meta, blobs
