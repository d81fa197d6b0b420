"""Smoke benchmark: per-turn latency through the session server vs direct.

Starts an emulator worker and a session server as separate processes on
loopback, runs the same multi-turn conversations (a) through the server and
(b) straight to the emulator, and prints p50/p99 per-turn latency and the
server's added latency. Not a test: run by hand.

    .venv/bin/python benches/smoke.py --sessions 8 --turns 8
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import trio
from _common import as_worker_request

from rollout_session.emulator import bundled_tokenizer_path


async def start(command: list[str], marker: str, nursery: trio.Nursery) -> tuple[str, Any]:
    process: trio.Process = await nursery.start(
        functools.partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
    )
    assert process.stdout is not None
    buffer = b""
    with trio.fail_after(60):
        async for chunk in process.stdout:
            buffer += chunk
            for line in buffer.decode().splitlines():
                if line.startswith(marker):
                    return line.rsplit(" ", 1)[1], process
    raise SystemExit(f"{command} exited: {buffer.decode()}")


async def conversation(
    client: httpx.AsyncClient, url: str, turns: int, latencies: list[float], direct: bool
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Let us begin."}]
    for i in range(turns):
        body: dict[str, Any] = {"messages": messages, "max_tokens": 64, "seed": i}
        if direct:  # what the server would send (built outside the timed call)
            body = as_worker_request(body)
        started = time.perf_counter()
        response = await client.post(url, json=body)
        latencies.append(time.perf_counter() - started)
        response.raise_for_status()
        message = response.json()["choices"][0]["message"]
        messages += [
            {"role": "assistant", "content": message["content"]},
            {"role": "user", "content": f"Continue with step {i}."},
        ]


async def run_mode(server: str | None, worker: str, args: argparse.Namespace) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
        for _ in range(args.sessions):
            if server is None:
                url = f"{worker}/v1/chat/completions"
            else:
                created = (await client.post(f"{server}/sessions")).json()
                url = f"{server}{created['base_url']}/chat/completions"
            nursery.start_soon(conversation, client, url, args.turns, latencies, server is None)
    return latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000


async def main(args: argparse.Namespace) -> None:
    python = [sys.executable, "-m", "rollout_session"]
    async with trio.open_nursery() as nursery:
        worker, emulator = await start(
            [*python, "emulator", "--port", "0"], "SGLang emulator listening on", nursery
        )
        server, session_server = await start(
            [
                *python,
                "serve",
                "--port",
                "0",
                "--worker",
                worker,
                "--log-level",
                "warning",
                "--tokenizer",
                str(bundled_tokenizer_path()),
            ],
            "rollout-session listening on",
            nursery,
        )
        await run_mode(server, worker, args)  # warm-up
        direct = await run_mode(None, worker, args)
        through = await run_mode(server, worker, args)
        print(f"{args.sessions} sessions x {args.turns} turns, concurrent sessions")
        print(f"{'path':<22}{'p50 ms':>10}{'p99 ms':>10}")
        for name, values in (("direct to emulator", direct), ("through server", through)):
            print(f"{name:<22}{pct(values, 50):>10.2f}{pct(values, 99):>10.2f}")
        print(f"{'added (p50)':<22}{pct(through, 50) - pct(direct, 50):>10.2f}")
        for process in (session_server, emulator):
            process.terminate()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    trio.run(main, parser.parse_args())
