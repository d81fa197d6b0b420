"""On-disk layer of the session journal: segment files, record framing, scanning.

Owns the bytes: how a record is framed and checked, how records are appended
(`write_records`), how a segment is named, installed and read back
(`replay_segment`, which also cuts off a torn tail). It knows nothing about
sessions: what a record means, and how records rebuild sessions, is
`journal_records`; the journal itself (writer, compaction) is `journal`.

A journal directory holds segments ``journal-NNNNNN.log`` (N grows by one per
compaction). Every segment is self-contained: a ``begin`` record (``v``
format version, ``seg`` segment number), one ``snapshot`` record per session
live when it was written, then appended events. A new segment is written as
``….log.tmp``, fsynced, renamed into place (directory fsynced), and only then
are older segments deleted. So the highest-numbered segment always wins:
lower ones are leftovers of a crash mid-compaction and a ``.tmp`` one never
finished; both are deleted at start.

A record is ``u32 body length | u32 crc32(body) | body`` (little-endian), and
a body is ``u32 meta length | meta | blob 0 | blob 1 | …``: ``meta`` is an
orjson object whose ``"t"`` is the record type and whose ``"b"`` lists the
byte length of each blob. Blobs hold the arrays raw (int32 ids and float32
logprobs little-endian, routed experts as the worker's int32 bytes), so
logprobs round-trip bit-exactly and encoding a turn is a memcpy, not a
number-to-text conversion (measured: 30k-token delta 15 µs raw vs 0.56 ms
base64 vs 1.7 ms orjson numpy lists).

A record whose header, length or crc is wrong ends the readable part of a
segment (a crash mid-write leaves exactly that): replay truncates the segment
there and keeps the dropped bytes as ``….log.bad-OFFSET`` for a post-mortem.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

__all__ = [
    "HEADER",
    "VERSION",
    "JournalError",
    "Parts",
    "Record",
    "begin_meta",
    "encode",
    "framed_size",
    "fsync_dir",
    "install_segment",
    "replay_segment",
    "scan",
    "segment_name",
    "segments",
    "write_records",
]

# The journal's one logger, whichever of its modules speaks.
logger = logging.getLogger("rollout_session.journal")

VERSION = 1
HEADER = struct.Struct("<II")  # body length, crc32(body)
_META = struct.Struct("<I")  # meta length
_MIN_BODY = _META.size + 2  # an empty meta is "{}": a zero-filled tail never passes
_MAX_BODY = 2**32 - 1
_SEGMENT = re.compile(r"^journal-(\d{6,})\.log$")
_IOV_MAX = 512  # below every platform's IOV_MAX

Parts = list[bytes]


class JournalError(Exception):
    """The journal cannot be read or written; durability is not guaranteed."""


def segment_name(number: int) -> str:
    return f"journal-{number:06d}.log"


def segments(directory: Path) -> list[tuple[int, Path]]:
    found = ((_SEGMENT.match(p.name), p) for p in directory.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


def encode(meta: dict[str, Any], blobs: Sequence[bytes] = ()) -> Parts:
    """A record body as parts (no copy of the blobs); framed by the writer."""
    meta["b"] = [len(b) for b in blobs]
    head = orjson.dumps(meta)
    parts = [_META.pack(len(head)), head, *blobs]
    if sum(len(p) for p in parts) > _MAX_BODY:
        raise JournalError(f"journal record for {meta.get('id')!r} is over 4 GiB")
    return parts


def framed_size(parts: Parts) -> int:
    return HEADER.size + sum(len(p) for p in parts)


def write_records(fd: int, records: list[Parts], sync: bool) -> None:
    """Frame (crc) and append records with one writev loop (worker thread)."""
    bufs: list[memoryview] = []
    for parts in records:
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        bufs.append(memoryview(HEADER.pack(framed_size(parts) - HEADER.size, crc)))
        bufs.extend(memoryview(p) for p in parts if len(p))
    i = 0
    while i < len(bufs):
        written = os.writev(fd, bufs[i : i + _IOV_MAX])
        while written:  # a short write resumes mid-buffer
            if written >= len(bufs[i]):
                written -= len(bufs[i])
                i += 1
            else:
                bufs[i] = bufs[i][written:]
                written = 0
    if sync:
        os.fsync(fd)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install_segment(directory: Path, number: int, tmp: Path) -> int:
    """Make a fully written, fsynced segment the live one; return an append fd
    to it. Older segments go once the rename is durable (they lose from then on)."""
    final = directory / segment_name(number)
    os.replace(tmp, final)
    fsync_dir(directory)
    append_fd = os.open(final, os.O_WRONLY | os.O_APPEND)
    try:
        for n, path in segments(directory):
            if n < number:
                path.unlink()
        fsync_dir(directory)
    except BaseException:
        os.close(append_fd)  # the caller gets no fd to close
        raise
    return append_fd


@dataclass(slots=True)
class Record:
    offset: int
    size: int  # framed size on disk
    meta: dict[str, Any]
    blobs: list[memoryview]


def scan(data: bytes, on_record: Callable[[Record], None]) -> tuple[int, str | None]:
    """Decode records in order until the first torn or corrupt one.

    Returns (end offset of the last good record, why scanning stopped early
    or None). Records are handed over as they are decoded (not kept: fewer
    live objects, less GC work). Nothing past a bad record is trusted:
    without a resync marker a wrong length makes every later offset moot.
    """
    view = memoryview(data)
    pos = 0
    while pos < len(data):
        if len(data) - pos < HEADER.size:
            return pos, "torn record header"
        size, crc = HEADER.unpack_from(data, pos)
        start = pos + HEADER.size
        end = start + size
        if size < _MIN_BODY:
            return pos, f"impossible record length {size}"
        if end > len(data):
            return pos, "torn record"
        body = view[start:end]
        if zlib.crc32(body) != crc:
            return pos, "crc mismatch"
        try:
            meta, blobs = _split(body)
        except (ValueError, TypeError) as exc:
            return pos, f"undecodable record ({exc})"
        on_record(Record(pos, end - pos, meta, blobs))
        pos = end
    return pos, None


def replay_segment(path: Path, number: int, on_record: Callable[[Record], None]) -> int:
    """Hand each record after the ``begin`` one to `on_record` (in order);
    truncate a torn/corrupt tail. Returns the segment's good size."""
    data = path.read_bytes()  # records are views into it until replay copies them
    header: list[dict[str, Any]] = []

    def take(record: Record) -> None:
        if header:
            on_record(record)
            return
        header.append(record.meta)
        if record.meta["t"] != "begin" or record.meta.get("v") != VERSION:
            raise JournalError(f"{path}: not a journal segment of format {VERSION}")

    end, problem = scan(data, take)
    if not header:
        # Segments only appear by rename once complete: this is not ours.
        raise JournalError(f"{path} does not start with a journal header ({problem})")
    if header[0].get("seg") != number:
        logger.warning("journal %s: header says segment %s", path, header[0].get("seg"))
    if problem is not None:
        dropped = len(data) - end
        logger.warning(
            "journal %s: %s at offset %d, dropping %d bytes", path, problem, end, dropped
        )
        # Usually a write cut short by a crash, but a bad length or crc can
        # also hide good records behind it: keep the bytes for a post-mortem.
        path.with_name(f"{path.name}.bad-{end}").write_bytes(data[end:])
        with path.open("r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return end


def _split(body: memoryview) -> tuple[dict[str, Any], list[memoryview]]:
    (meta_len,) = _META.unpack_from(body)
    end = _META.size + meta_len
    meta = orjson.loads(body[_META.size : end])
    if not isinstance(meta, dict) or not isinstance(meta.get("t"), str):
        raise TypeError("meta is not an object with a type")
    blobs = []
    for n in meta.get("b", []):
        blobs.append(body[end : end + n])
        end += n
    if end != len(body):
        raise ValueError("blob lengths do not add up")
    return meta, blobs


def begin_meta(segment: int) -> dict[str, Any]:
    """The meta of a segment's first record (checked by `replay_segment`)."""
    return {"t": "begin", "v": VERSION, "seg": segment}
