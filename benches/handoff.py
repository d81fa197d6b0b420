"""What handing an answer to a validation process, and its result back, costs.

One job at a time, a trio-parallel worker process runs the server's own
`check_answer` on a logprobs answer shaped like P1's (``--entries`` 30k
``[logprob, id]`` entries with full-precision floats, 0.82 MiB; the result
holds two 120 KB arrays), three ways:

- ``pipe``: the answer as a pickled argument and the result back through
  trio-parallel's pipe (what the server did first);
- ``file in``: the answer through a tmpfs hand-off file, the result through
  the pipe (the server before its results came back out of band);
- ``file in+out``: `rollout_session.turn.handoff.Handoff.run_sync`, what the
  server does now: the result's arrays come back through the same file.

Every mode pays the same decode; the differences are the transfers. Reports
wall time and the CPU of this process plus the worker process per job.

    python benches/handoff.py
    python benches/handoff.py --entries 60000 --jobs 100
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from typing import Any

import orjson
import trio
import trio_parallel
from _common import proc_stats, table

from rollout_session.engines.answer import AnswerCheck
from rollout_session.engines.sglang_chat.answer import check_answer
from rollout_session.turn.handoff import Handoff

VOCAB = 129_280
MODES = ("pipe", "file in", "file in+out")


def _check_from_file(path: str, check: AnswerCheck) -> Any:
    """The ``file in`` job: the answer from the file, the result returned
    (pickled through the pipe by trio-parallel)."""
    with open(path, "rb") as file:
        return check_answer(file.read(), check)


def _answer(entries: int) -> bytes:
    rng = random.Random(0)
    meta = {
        "output_token_logprobs": [
            [-rng.random() * 5, rng.randrange(VOCAB)] for _ in range(entries)
        ],
        "completion_tokens": entries,
        "prompt_tokens": 1,
    }
    message = {"content": "x" * entries}
    return orjson.dumps({"choices": [{"message": message, "meta_info": meta}]})


def _cpu_s(pids: list[int]) -> float:
    stats = proc_stats()
    return sum(stats[pid][1] for pid in pids)


def _children() -> list[int]:
    me = os.getpid()
    return [pid for pid, (parent, _) in proc_stats().items() if parent == me]


async def main(args: argparse.Namespace) -> None:
    data = _answer(args.entries)
    check = AnswerCheck(sent_prompt_tokens=1, vocab_size=VOCAB)
    unbounded = trio.CapacityLimiter(math.inf)
    handoff = Handoff()
    rows = []
    try:
        async with trio_parallel.open_worker_context(idle_timeout=60) as workers:
            await workers.run_sync(check_answer, data, check)  # warm-up
            pids = [os.getpid(), *_children()]
            for round_ in range(args.rounds):
                for mode in MODES[round_ % 2 :] + MODES[: round_ % 2]:
                    cpu, started = _cpu_s(pids), time.perf_counter()
                    for _ in range(args.jobs):
                        if mode == "pipe":
                            await workers.run_sync(check_answer, data, check)
                        elif mode == "file in":
                            with handoff.file(data) as path:
                                assert path is not None
                                await workers.run_sync(_check_from_file, path, check)
                        else:
                            await handoff.run_sync(
                                workers, check_answer, data, check, limiter=unbounded
                            )
                    wall = time.perf_counter() - started
                    rows.append(
                        {
                            "round": round_,
                            "hand-off": mode,
                            "MiB": round(len(data) / 2**20, 2),
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
    parser.add_argument("--entries", type=int, default=30_000, help="logprob entries per answer")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    trio.run(main, parser.parse_args())
