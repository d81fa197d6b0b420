"""Hand-off files: what a validation process reads, gone when the job is."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rollout_session.handoff import Handoff, call_with_file


def test_file_holds_the_data_until_the_block_ends(tmp_path: Path) -> None:
    handoff = Handoff(tmp_path)
    assert handoff.directory is None  # made on first use
    data = os.urandom(300_000)
    with handoff.file(data) as path:
        assert path is not None and handoff.directory is not None
        assert Path(path).parent == handoff.directory
        assert handoff.directory.parent == tmp_path
        assert oct(Path(path).stat().st_mode & 0o777) == "0o600"
        assert call_with_file(path, lambda got, extra: (got, extra), 7) == (data, 7)
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


def test_default_directory_is_shared_memory_when_there_is_one() -> None:
    handoff = Handoff()
    try:
        with handoff.file(b"x"):
            pass
        assert handoff.directory is not None
        if os.access("/dev/shm", os.W_OK):
            assert handoff.directory.parent == Path("/dev/shm")
        assert handoff.directory.name.startswith("rollout-session-")
    finally:
        handoff.close()
