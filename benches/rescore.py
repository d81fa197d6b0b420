"""Rescore throughput: the server's CPU per rescored token against its CPU
per turn token (issue 33's bench).

An SGLang emulator (the policy), a second one with another seed (the
teacher, ``--teacher-worker``) and a session server, each its own process
on loopback. ``--sessions`` sessions each take one turn whose prompt is
~``--tokens`` tokens (one token per filler word) and whose answer is at
most ``--answer-tokens`` tokens (the emulator's answers end sooner); then
every session is rescored by the teacher, ``--concurrency`` at a time,
``--repeats`` times (a rescore repeated under a label replaces itself).
Reported: the server's CPU per 1k tokens in the turn phase and per 1k
rescored tokens (both over the same tokens: every position of every
segment is sent), rescored tokens per second of server CPU, and the
rescore phase's wall time; the median over the repeats.

    .venv/bin/python benches/rescore.py --sessions 64 --tokens 8000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx
import trio
from _common import (
    WORDS,
    Child,
    bench_parser,
    child,
    emulator_command,
    load_average,
    server_command,
)


def _prompt(tokens: int, salt: int) -> str:
    words = [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(tokens)]
    return " ".join(words)


async def _turns(client: httpx.AsyncClient, server: str, args: argparse.Namespace) -> list[str]:
    ids: list[str] = []
    limit = trio.CapacityLimiter(args.concurrency)

    async def one(i: int) -> None:
        async with limit:
            created = (await client.post(f"{server}/sessions")).json()
            body = {
                "messages": [{"role": "user", "content": _prompt(args.tokens, i)}],
                "max_tokens": args.answer_tokens,
                "ignore_eos": True,
            }
            answer = await client.post(f"{server}{created['base_url']}/chat/completions", json=body)
            answer.raise_for_status()
            ids.append(created["session_id"])

    async with trio.open_nursery() as nursery:
        for i in range(args.sessions):
            nursery.start_soon(one, i)
    return ids


async def _rescores(
    client: httpx.AsyncClient, server: str, ids: list[str], concurrency: int
) -> int:
    """Rescore every session; the number of positions scored."""
    scored = 0
    limit = trio.CapacityLimiter(concurrency)

    async def one(session_id: str) -> None:
        nonlocal scored
        async with limit:
            answer = await client.post(
                f"{server}/sessions/{session_id}/rescore",
                json={"target": "teacher", "label": "teacher"},
            )
            answer.raise_for_status()
            scored += sum(s["scored_tokens"] for s in answer.json()["segments"])

    async with trio.open_nursery() as nursery:
        for session_id in ids:
            nursery.start_soon(one, session_id)
    return scored


async def main(args: argparse.Namespace) -> None:
    context = str(args.tokens + args.answer_tokens + 1024)
    async with (
        child("policy", emulator_command("--seed", "0", "--context-length", context)) as policy,
        child(
            "teacher", emulator_command("--seed", "1000", "--context-length", context)
        ) as teacher,
        child(
            "server",
            server_command([policy.url], "--teacher-worker", teacher.url),
        ) as server,
        httpx.AsyncClient(timeout=600) as client,
    ):
        print(load_average())
        rows: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            before = server.main_cpu_s()
            ids = await _turns(client, server.url, args)
            turn_cpu = server.main_cpu_s() - before
            before, started = server.main_cpu_s(), time.perf_counter()
            scored = await _rescores(client, server.url, ids, args.concurrency)
            rescore_cpu = server.main_cpu_s() - before
            wall = time.perf_counter() - started
            rows.append(
                {
                    # The turns made exactly the tokens the rescores score.
                    "turn_cpu_ms_per_1k": 1000 * turn_cpu / scored * 1000,
                    "rescore_cpu_ms_per_1k": 1000 * rescore_cpu / scored * 1000,
                    "rescored_per_cpu_s": scored / rescore_cpu,
                    "rescore_wall_s": wall,
                    "scored": scored,
                }
            )
            for session_id in ids:
                await client.delete(f"{server.url}/sessions/{session_id}")
            print(f"repeat {repeat}: {rows[-1]}")
        report(rows, args, server)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, server: Child) -> None:
    def median(key: str) -> str:
        values = [r[key] for r in rows]
        return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"

    per_session = rows[0]["scored"] / args.sessions
    print(
        f"\n{args.sessions} sessions of {per_session:.0f} tokens (prompt and answer), "
        f"rescored by the teacher {args.concurrency} at a time; median (range) of {len(rows)}"
    )
    print(
        "| server CPU ms per 1k turn tokens | per 1k rescored tokens | rescored tokens per "
        "server CPU s | rescore wall s |"
    )
    print("|---|---|---|---|")
    print(
        f"| {median('turn_cpu_ms_per_1k')} | {median('rescore_cpu_ms_per_1k')} | "
        f"{median('rescored_per_cpu_s')} | {median('rescore_wall_s')} |"
    )
    print(load_average())


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8000, help="prompt tokens per session")
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=256,
        help="the turn's max_tokens (answers may end sooner)",
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    trio.run(main, parser.parse_args())
