"""`rollout_session.fleet.ray.start_fleet` on a local Ray cluster (loopback): a
2-actor demo fleet, 20 sessions through its client, a clean shutdown.

Run by scripts/test-ray (Ray takes seconds to start: not in the default suite).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

ray = pytest.importorskip("ray")

from rollout_session.client import rendezvous_owner  # noqa: E402
from rollout_session.fleet.ray import start_fleet  # noqa: E402
from tests.conftest import agent_turn  # noqa: E402


def _descendants(root: int) -> set[int]:
    """Every live process below `root` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _serving(pids: set[int]) -> set[int]:
    """The processes among `pids` that run a session server or an emulator
    (their open listening sockets are ours; Ray's own are not counted)."""
    out = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"_ShardActor" in cmdline or b"_DemoActor" in cmdline:
            out.add(pid)
        elif b"multiprocessing" in cmdline or b"trio_parallel" in cmdline:
            out.add(pid)  # a shard's validation processes
    return out


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()


async def test_two_actor_fleet_runs_20_sessions_and_shuts_down_cleanly(cluster: Any) -> None:
    before = _serving(_descendants(os.getpid()))
    fleet = await trio.to_thread.run_sync(
        lambda: start_fleet(num_servers=2, demo=True, host="127.0.0.1", log_level="warning")
    )
    try:
        assert len(fleet.urls) == 2
        started = _serving(_descendants(os.getpid())) - before
        assert started, "the actors run below this driver's Ray processes"
        async with fleet.client() as client:
            handles = [await client.create(metadata={"i": i}) for i in range(20)]
            assert {h.server for h in handles} == set(fleet.urls)  # both shards used
            for i, handle in enumerate(handles):
                assert handle.server == rendezvous_owner(fleet.urls, handle.session_id)
                await trio.to_thread.run_sync(
                    partial(agent_turn, handle.base_url, content=f"task {i}")
                )
            for i, handle in enumerate(handles):
                doc = await client.close(handle)
                assert doc["status"] == "closed" and doc["metadata"] == {"i": i}
                assert len(doc["segments"][0]["turns"]) == 1
    finally:
        await trio.to_thread.run_sync(fleet.shutdown)
    # Every actor process (and its validation processes) is gone.
    with trio.fail_after(30):
        # Processes exit in their own time: nothing to wait on but /proc.
        while _serving(_descendants(os.getpid())) & started:  # noqa: ASYNC110
            await trio.sleep(0.1)
