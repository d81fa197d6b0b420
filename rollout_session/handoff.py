"""Handing a large input to a validation process, and its result back,
through a file in memory.

A worker answer sent to a validation process as an argument is pickled
through trio-parallel's pipe: 64 KiB at a time, each chunk a wake-up of both
processes, and under load each chunk waits for the event loop to come round.
Written to a file on tmpfs (``/dev/shm``) and read back by the process, a
0.71 MiB answer costs 1-3 ms less CPU (`benches/handoff.py`). The result
comes back the same way: its large buffers (the answer's id and logprob
arrays, 240 KB for 30k tokens) are pickled out of band (protocol 5) into the
same file, and only the rest travels through the pipe. `Handoff` owns one
private directory for those files; at most one file per running job exists
at a time, and each is removed as soon as its job is done. A process killed
with SIGKILL leaves the directory behind (``rollout-session-*``, holding at
most those files).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar, cast

import trio
import trio_parallel

__all__ = ["FileReply", "Handoff", "call_with_file"]

logger = logging.getLogger("rollout_session")

T = TypeVar("T")

# tmpfs where there is one (Linux): the file never touches a disk.
_SHARED_MEMORY = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class FileReply(Generic[T]):
    """A job's result as it crosses the pipe: pickled (protocol 5) without
    its out-of-band buffers, which the job wrote into the hand-off file in
    this order and these sizes."""

    pickled: bytes
    sizes: tuple[int, ...]

    def load(self, path: str) -> T:
        """In the server: the result, its buffers read back from `path`."""
        buffers = []
        with open(path, "rb", buffering=0) as file:
            for size in self.sizes:
                # bytearray, not bytes: arrays rebuilt on it stay writable.
                buffer = bytearray(size)
                if file.readinto(buffer) != size:
                    raise RuntimeError(f"hand-off file {path} is shorter than its reply")
                buffers.append(buffer)
        return cast(T, pickle.loads(self.pickled, buffers=buffers))


def call_with_file(path: str, fn: Callable[..., T], *args: object) -> FileReply[T]:
    """In the validation process: `fn(contents of path, *args)`, its large
    buffers written back over the input (read by then)."""
    with open(path, "rb") as file:
        data = file.read()
    result = fn(data, *args)
    buffers: list[pickle.PickleBuffer] = []
    pickled = pickle.dumps(result, protocol=5, buffer_callback=buffers.append)
    if not buffers:
        return FileReply(pickled, ())
    views = [buffer.raw() for buffer in buffers]
    try:
        with open(path, "wb") as file:
            for view in views:
                file.write(view)
    except OSError:
        # A full tmpfs, say: the whole result goes through the pipe.
        return FileReply(pickle.dumps(result, protocol=5), ())
    return FileReply(pickled, tuple(view.nbytes for view in views))


class Handoff:
    """A private directory of hand-off files, made on first use (a server
    that never sees a large answer leaves nothing behind) and removed by
    `close`."""

    def __init__(self, base: Path | None = None) -> None:
        self._base = base
        self.directory: Path | None = None
        self._names = itertools.count()
        self.files_written = 0

    def _directory(self) -> Path:
        if self.directory is None:
            base = self._base
            if base is None:
                usable = _SHARED_MEMORY.is_dir() and os.access(_SHARED_MEMORY, os.W_OK)
                base = _SHARED_MEMORY if usable else Path(tempfile.gettempdir())
            self.directory = Path(tempfile.mkdtemp(prefix="rollout-session-", dir=base))
        return self.directory

    async def run_sync(
        self,
        workers: trio_parallel.WorkerContext,
        fn: Callable[..., T],
        data: bytes,
        *args: object,
        limiter: trio.CapacityLimiter,
    ) -> T:
        """`fn(data, *args)` in one of `workers`, `data` and the result's
        large buffers through a hand-off file (the pipe if none can be
        written)."""
        with self.file(data) as path:
            if path is None:
                result: T = await workers.run_sync(fn, data, *args, limiter=limiter)
                return result
            reply: FileReply[T] = await workers.run_sync(
                call_with_file, path, fn, *args, limiter=limiter
            )
            return reply.load(path)

    @contextlib.contextmanager
    def file(self, data: bytes) -> Iterator[str | None]:
        """A file holding `data` while the block runs; None if it could not
        be written (full tmpfs, say): then the caller uses the pipe."""
        path: Path | None = None
        try:
            path = self._directory() / str(next(self._names))
            _write(path, data)
        except OSError as exc:
            logger.warning("hand-off file not written (%s); using the pipe", exc)
            if path is not None:
                path.unlink(missing_ok=True)
            yield None
            return
        self.files_written += 1
        try:
            yield str(path)
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self.directory is None:
            return
        for leftover in self.directory.iterdir():
            leftover.unlink(missing_ok=True)
        self.directory.rmdir()


def _write(path: Path, data: bytes) -> None:
    # O_EXCL: the name is ours alone; 0o600: answers are not for other users.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
