"""A journal directory on a filesystem of a few bytes, for tests.

A real small filesystem needs root to mount; this stands in for one where
the journal writes (`write_records`, appends and compaction alike): the
directory's files may hold `capacity` bytes in all. A write that does not
fit writes what fits, then fails with ENOSPC, as `write(2)` on a full
filesystem does; truncating or deleting a file gives its bytes back.
"""

from __future__ import annotations

import errno
import math
import os
import zlib
from pathlib import Path

import pytest

from rollout_session.session.journal import compaction as journal_compaction
from rollout_session.session.journal import format as fmt
from rollout_session.session.journal import writer as journal_module


class TinyDisk:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.capacity: float = math.inf
        self.refused = 0  # writes that did not fit

    def used(self) -> int:
        if not self.directory.exists():
            return 0
        return sum(p.stat().st_size for p in self.directory.iterdir() if p.is_file())

    def fill(self, spare: int = 0) -> None:
        """From now on, only `spare` more bytes fit."""
        self.capacity = self.used() + spare

    def free(self) -> None:
        """Room again (the operator cleaned up)."""
        self.capacity = math.inf

    def write_records(self, fd: int, records: list[fmt.Parts], sync: bool) -> None:
        frames = b"".join(_frame(parts) for parts in records)
        room = self.capacity - self.used()
        if len(frames) > room:
            self.refused += 1
            if room > 0:
                os.write(fd, frames[: int(room)])
            raise OSError(errno.ENOSPC, "No space left on device")
        fmt.write_records(fd, records, sync)


def _frame(parts: fmt.Parts) -> bytes:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return fmt.HEADER.pack(fmt.framed_size(parts) - fmt.HEADER.size, crc) + b"".join(parts)


def tiny_disk(monkeypatch: pytest.MonkeyPatch, directory: Path) -> TinyDisk:
    """Put the journal writing into `directory` on a `TinyDisk`."""
    disk = TinyDisk(directory)
    monkeypatch.setattr(journal_module, "write_records", disk.write_records)
    monkeypatch.setattr(journal_compaction, "write_records", disk.write_records)
    return disk
