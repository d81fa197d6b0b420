"""Hand-off files: what a validation process reads, gone when the job is."""

from __future__ import annotations

import builtins
import errno
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import trio
import trio_parallel

from rollout_session.engines.answer import AnswerCheck
from rollout_session.engines.sglang_chat.answer import check_answer
from rollout_session.turn.handoff import PREFIX, STALE_AFTER_S, Handoff, call_with_file, sweep


def test_file_holds_the_data_until_the_block_ends(tmp_path: Path) -> None:
    handoff = Handoff(tmp_path)
    assert handoff.directory is None  # made on first use
    data = os.urandom(300_000)
    with handoff.file(data) as path:
        assert path is not None and handoff.directory is not None
        assert Path(path).parent == handoff.directory
        assert handoff.directory.parent == tmp_path
        assert oct(Path(path).stat().st_mode & 0o777) == "0o600"
        reply = call_with_file(path, lambda got, extra: (got, extra), 7)
        assert reply.sizes == ()  # bytes are pickled in band
        assert reply.load(path) == (data, 7)
    assert list(handoff.directory.iterdir()) == []
    assert handoff.files_written == 1
    handoff.close()
    assert not handoff.directory.exists()
    Handoff(tmp_path).close()  # never used: nothing to remove


def test_file_is_removed_when_the_job_fails(tmp_path: Path) -> None:
    handoff = Handoff(tmp_path)
    with pytest.raises(ValueError), handoff.file(b"x") as path:
        assert path is not None
        raise ValueError
    assert handoff.directory is not None and list(handoff.directory.iterdir()) == []


@pytest.mark.parametrize("broken", ["no-base", "directory-gone"])
def test_unwritable_directory_falls_back_to_the_pipe(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    handoff = Handoff(tmp_path / "missing" if broken == "no-base" else tmp_path)
    if broken == "directory-gone":  # e.g. a tmpfs cleaned under the server
        with handoff.file(b"x"):
            pass
        assert handoff.directory is not None
        handoff.directory.rmdir()
    with caplog.at_level(logging.WARNING, logger="rollout_session"), handoff.file(b"y") as path:
        assert path is None
    assert "using the pipe" in caplog.text
    assert handoff.files_written == (0 if broken == "no-base" else 1)
    handoff.close()  # a directory removed under it is not an error


def test_default_directory_is_shared_memory_when_there_is_one() -> None:
    handoff = Handoff()
    try:
        with handoff.file(b"x"):
            pass
        assert handoff.directory is not None
        if os.access("/dev/shm", os.W_OK):
            assert handoff.directory.parent == Path("/dev/shm")
        assert handoff.directory.name.startswith(PREFIX)
    finally:
        handoff.close()


_KILLED_MID_JOB = """
import os, signal, sys
from pathlib import Path
from rollout_session.turn.handoff import Handoff
job = Handoff(Path(sys.argv[1])).file(b"answer")
job.__enter__()  # a job's file is in the directory when the process dies
os.kill(os.getpid(), signal.SIGKILL)
"""


def _age(directory: Path) -> None:
    old = time.time() - STALE_AFTER_S - 1
    os.utime(directory, (old, old))


def test_a_new_directory_sweeps_those_of_dead_servers(tmp_path: Path) -> None:
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_JOB, str(tmp_path)], check=False)
    assert killed.returncode == -signal.SIGKILL
    (dead,) = tmp_path.iterdir()
    assert [f.read_bytes() for f in dead.iterdir()] == [b"answer"]  # what SIGKILL leaves
    live = Handoff(tmp_path)
    with live.file(b"x"):
        pass
    fresh = Path(tempfile.mkdtemp(prefix=PREFIX, dir=tmp_path))  # not locked yet
    older_version = tmp_path / "rollout-session-abcd1234"
    older_version.mkdir()
    assert live.directory is not None
    for directory in (dead, live.directory, older_version):
        _age(directory)

    new = Handoff(tmp_path)
    with new.file(b"y"):
        pass
    assert new.directory is not None
    assert not dead.exists()
    assert sorted(tmp_path.iterdir()) == sorted(
        [live.directory, fresh, older_version, new.directory]
    )
    assert sweep(tmp_path) == []  # nothing else is stale
    live.close()
    _age(fresh)
    assert sweep(tmp_path) == [fresh]
    new.close()
    assert list(tmp_path.iterdir()) == [older_version]


def test_sweep_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    # /dev/shm is world-writable: anyone can name a link like our directories.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_bytes(b"k")
    _age(victim)
    base = tmp_path / "shm"
    base.mkdir()
    (base / f"{PREFIX}planted").symlink_to(victim)
    assert sweep(base) == []
    assert (victim / "keep").read_bytes() == b"k"


def _arrays(data: bytes, n: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], str]:
    ids = np.frombuffer(data, np.int32)
    return ids.copy(), (ids * 0.5).astype(np.float32), f"{n} extra"


def test_result_arrays_come_back_through_the_file(tmp_path: Path) -> None:
    handoff = Handoff(tmp_path)
    data = np.arange(30_000, dtype=np.int32).tobytes()
    with handoff.file(data) as path:
        assert path is not None
        reply = call_with_file(path, _arrays, 3)
        assert reply.sizes == (120_000, 120_000)
        assert len(reply.pickled) < 1_000  # the arrays are not in it
        ids, logprobs, extra = reply.load(path)
    assert extra == "3 extra"
    np.testing.assert_array_equal(ids, np.arange(30_000))
    np.testing.assert_array_equal(logprobs, np.arange(30_000) * 0.5)
    assert ids.flags.writeable and logprobs.dtype == np.float32


def test_result_goes_through_the_pipe_when_the_file_cannot_be_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(path: str, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, mode, *args, **kwargs)

    handoff = Handoff(tmp_path)
    with handoff.file(np.arange(10, dtype=np.int32).tobytes()) as path:
        assert path is not None
        monkeypatch.setattr("rollout_session.turn.handoff.open", no_space, raising=False)
        reply = call_with_file(path, _arrays, 1)
        assert reply.sizes == ()
        ids, _, _ = reply.load(path)
    np.testing.assert_array_equal(ids, np.arange(10))


async def test_run_sync_in_a_worker_process(tmp_path: Path) -> None:
    """What the server runs there: `check_answer` on a 20k-token answer."""
    entries = [[-0.25, token, None] for token in range(20_000)]
    meta = {"output_token_logprobs": entries, "completion_tokens": 20_000, "prompt_tokens": 3}
    body = orjson.dumps({"choices": [{"message": {"content": "x"}, "meta_info": meta}]})
    handoff = Handoff(tmp_path)
    async with trio_parallel.open_worker_context() as workers:
        answer, experts = await handoff.run_sync(
            workers,
            check_answer,
            body,
            AnswerCheck(sent_prompt_tokens=3, vocab_size=50_000),
            limiter=trio.CapacityLimiter(math.inf),
        )
    np.testing.assert_array_equal(answer.ids, np.arange(20_000))
    np.testing.assert_array_equal(answer.logprobs, np.full(20_000, -0.25, np.float32))
    assert answer.ids.flags.writeable  # rebuilt on our buffer, not on bytes
    assert experts is None and answer.content == "x"
    assert handoff.files_written == 1
    assert handoff.directory is not None and list(handoff.directory.iterdir()) == []
