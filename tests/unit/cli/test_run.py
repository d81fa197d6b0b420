"""The connection cap within the process's file descriptor limit (cli/run.py)."""

from __future__ import annotations

import pytest

from rollout_session.cli.run import connection_cap


@pytest.mark.parametrize(
    ("max_connections", "reserve", "fd_limit", "cap"),
    [
        (4096, 192, 1_048_576, 4096),
        (4096, 192, 4288, 4096),
        (4096, 192, 4287, 4095),
        (4096, 192, 1024, 832),
        (4096, 192, 100, 1),
        (4096, 192, -1, 4096),
    ],
    ids=["roomy", "exact", "one-short", "default-ulimit", "tiny", "unlimited"],
)
def test_the_connection_cap_fits_the_descriptor_limit(
    max_connections: int, reserve: int, fd_limit: int, cap: int
) -> None:
    assert connection_cap(max_connections, reserve, fd_limit) == cap
