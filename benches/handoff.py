"""What handing an answer to a validation process costs: pipe vs hand-off file.

Sends the same bytes to a trio-parallel worker process that only takes their
length, one job at a time, either as a pickled argument (through
trio-parallel's pipe, what the server did before) or through
`rollout_session.handoff.Handoff` (a tmpfs file). Reports wall time and the
CPU of this process plus the worker process per job.

    python benches/handoff.py
    python benches/handoff.py --mib 1.3 --jobs 400
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import trio
import trio_parallel
from _common import table

from rollout_session.handoff import Handoff, call_with_file


def _cpu_s(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _children() -> list[int]:
    me = os.getpid()
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        if parent == me:
            pids.append(int(stat.parent.name))
    return pids


async def main(args: argparse.Namespace) -> None:
    data = os.urandom(int(args.mib * 2**20))
    handoff = Handoff()
    rows = []
    try:
        async with trio_parallel.open_worker_context(idle_timeout=60) as workers:
            await workers.run_sync(len, b"warm-up")
            pids = [os.getpid(), *_children()]
            for round_ in range(args.rounds):
                for mode in ("pipe", "file"):
                    cpu, started = _cpu_s(pids), time.perf_counter()
                    for _ in range(args.jobs):
                        if mode == "pipe":
                            await workers.run_sync(len, data)
                        else:
                            with handoff.file(data) as path:
                                assert path is not None
                                await workers.run_sync(call_with_file, path, len)
                    wall = time.perf_counter() - started
                    rows.append(
                        {
                            "round": round_,
                            "hand-off": mode,
                            "MiB": round(args.mib, 2),
                            "wall ms/job": round(wall / args.jobs * 1e3, 3),
                            "CPU ms/job": round((_cpu_s(pids) - cpu) / args.jobs * 1e3, 3),
                        }
                    )
    finally:
        handoff.close()
    print(f"hand-off directory: {handoff.directory.parent}")
    print(table(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mib", type=float, default=0.71, help="bytes per job (P1 logprobs)")
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    trio.run(main, parser.parse_args())
