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
at a time, and each is removed as soon as its job is done.

The server holds an ``flock`` on its directory for as long as it lives, and
the kernel drops it when the process dies, however it dies. A server that
makes its directory removes the ones left by dead servers (SIGKILL, OOM
kill): unlocked, named by this module, and untouched for `STALE_AFTER_S`.
A lock works across containers that share the tmpfs, which a pid would not.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar, cast

import trio
import trio_parallel

__all__ = ["PREFIX", "STALE_AFTER_S", "FileReply", "Handoff", "call_with_file", "sweep"]

logger = logging.getLogger("rollout_session")

T = TypeVar("T")

# tmpfs where there is one (Linux): the file never touches a disk.
_SHARED_MEMORY = Path("/dev/shm")
# Directories are named with this prefix. Older versions used
# "rollout-session-" + 8 characters of [a-z0-9_], never this, so a sweep
# never takes a live older server's (unlocked) directory for a dead one.
PREFIX = "rollout-session-handoff-"
# An unlocked directory is only removed once this old: a live server's new
# directory is unlocked between mkdtemp and flock.
STALE_AFTER_S = 60.0


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
        self._lock_fd: int | None = None  # flock held on `directory` while it exists
        self._names = itertools.count()
        self.files_written = 0

    def _directory(self) -> Path:
        if self.directory is None:
            base = self._base
            if base is None:
                usable = _SHARED_MEMORY.is_dir() and os.access(_SHARED_MEMORY, os.W_OK)
                base = _SHARED_MEMORY if usable else Path(tempfile.gettempdir())
            directory = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
            try:
                self._lock_fd = _lock(directory)
            except OSError:
                directory.rmdir()
                raise
            self.directory = directory
            sweep(base)
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
        if self.directory is None or self._lock_fd is None:
            return
        with contextlib.suppress(FileNotFoundError):  # a tmpfs cleaned under us
            _remove(self.directory, self._lock_fd)
        os.close(self._lock_fd)
        self._lock_fd = None


def _lock(directory: Path) -> int:
    """An fd of `directory` holding its exclusive flock; OSError if another
    process holds it, or if `directory` is a symlink: in a world-writable
    tmpfs anyone can plant one, and following it would empty its target."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _remove(directory: Path, fd: int) -> None:
    """Empty the directory open as `fd` (relative to the fd: no path to
    swap for a symlink meanwhile), then remove `directory`."""
    for name in os.listdir(fd):
        os.unlink(name, dir_fd=fd)
    directory.rmdir()


def sweep(base: Path) -> list[Path]:
    """Remove the hand-off directories in `base` whose server is gone; return
    them. One that is locked (its server lives), fresh, another user's, or
    not a directory is left alone; no error escapes, it is housekeeping."""
    removed: list[Path] = []
    try:
        candidates = list(base.glob(PREFIX + "*"))
    except OSError:
        return removed
    for directory in candidates:
        try:
            fd = _lock(directory)
        except OSError:  # locked, a symlink, not ours to open, or gone meanwhile
            continue
        try:
            stat = os.fstat(fd)
            if stat.st_uid == os.getuid() and time.time() - stat.st_mtime >= STALE_AFTER_S:
                _remove(directory, fd)
                removed.append(directory)
        except OSError as exc:
            logger.warning("stale hand-off directory %s not removed: %s", directory, exc)
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d hand-off directories of dead servers", len(removed))
    return removed


def _write(path: Path, data: bytes) -> None:
    # O_EXCL: the name is ours alone; 0o600: answers are not for other users.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
