"""Fleet throughput: one session server process vs ``serve --processes N``, same load.

The same closed-loop load (``--concurrency`` agents, each running sessions
of ``--turns`` small turns: a ~``--prompt-tokens`` first prompt, answers of
``--completion-tokens``) is run against a plain ``serve`` (N=1) and against
``serve --processes N`` for each N of ``--processes``, alternating,
``--repeats`` times, on the same emulator worker process. Agents create
their sessions with `SessionClient` over the fleet's URLs (straight to the
owner, as a trainer does) and talk to the ``base_url`` they get.

Reported per N: turns/s (all turns of a run over its wall time), latency
p50/p99, and CPU ms per turn of the servers (every shard and its
validation processes), the emulator and this load generator, from /proc;
plus the machine's other load ("foreign cores"). Every process shares the
same cores: read the CPU columns, not only turns/s.

    python benches/fleet.py
    python benches/fleet.py --processes 2,3 --concurrency 64 --json fleet.json
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from _common import (
    AGENT_ANSWER,
    Child,
    Window,
    agent_client,
    bench_parser,
    child,
    emulator_command,
    load_average,
    ms,
    pct,
    server_command,
    table,
    write_json,
)
from small_turns import first_prompt

from rollout_session.client import SessionClient


async def session(
    client: httpx.AsyncClient,
    trainer: SessionClient,
    index: int,
    args: argparse.Namespace,
    latencies: list[float],
    errors: list[str],
) -> None:
    handle = await trainer.create()
    url = f"{handle.base_url}/chat/completions"
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": first_prompt(args.prompt_tokens, index)}
    ]
    for turn in range(args.turns):
        body = orjson.dumps(
            {"messages": messages, "max_tokens": args.completion_tokens, "seed": index}
        )
        started = time.perf_counter()
        response = await client.post(
            url, content=body, headers={"content-type": "application/json"}
        )
        latency = time.perf_counter() - started
        if response.status_code != 200:
            errors.append(f"{response.status_code}: {response.content[:200]!r}")
            return
        latencies.append(latency)
        content = AGENT_ANSWER.decode(response.content).choices[0].message.content
        messages = [
            *messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"Continue with step {turn}."},
        ]
    await trainer.close(handle)


async def run_load(urls: list[str], args: argparse.Namespace, chats: int) -> dict[str, Any]:
    latencies: list[float] = []
    errors: list[str] = []
    sessions = max(1, chats // args.turns)
    counter = itertools.count()
    async with SessionClient(urls) as trainer:

        async def agent() -> None:
            async with agent_client(timeout=300) as client:
                for index in counter:
                    if index >= sessions:
                        return
                    await session(client, trainer, index, args, latencies, errors)

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(args.concurrency):
                nursery.start_soon(agent)
        wall = time.perf_counter() - started
    return {"latencies": latencies, "errors": errors, "wall_s": wall}


async def fleet_urls(front: Child, processes: int) -> list[str]:
    if processes == 1:
        return [front.url]
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"{front.url}/health?fleet=1")).json()
    return [shard["url"] for shard in health["shards"]]


async def main(args: argparse.Namespace) -> None:
    print(
        f"{load_average()}; {args.concurrency} agents, {args.turns} turns/session, prompt "
        f"~{args.prompt_tokens} tokens, {args.completion_tokens} completion tokens, "
        f"{args.chats} turns per run"
    )
    emulator_flags = ["--completion-tokens", str(args.completion_tokens), "--record-limit", "0"]
    rows: dict[int, dict[str, Any]] = {}
    async with child("emulator", emulator_command(*emulator_flags)) as emulator:
        for rep in range(args.repeats):
            order = [1, *args.processes]
            for n in order if rep % 2 == 0 else order[::-1]:
                flags = ["--processes", str(n)] if n > 1 else []
                marker = "rollout-session fleet of" if n > 1 else "rollout-session listening on"
                command = server_command([emulator.url], *flags)
                async with child(f"server-{n}", command, marker=marker) as server:
                    urls = await fleet_urls(server, n)
                    warm = argparse.Namespace(**vars(args))
                    await run_load(urls, warm, chats=4 * args.turns * len(urls))
                    window = Window([server, emulator])
                    result = await run_load(urls, args, chats=args.chats)
                    usage = window.finish()
                row = rows.setdefault(
                    n, {"latencies": [], "errors": [], "wall_s": 0.0, "cpu": {}, "foreign": []}
                )
                row["latencies"] += result["latencies"]
                row["errors"] += result["errors"]
                row["wall_s"] += result["wall_s"]
                row["foreign"].append(usage["foreign_cores"])
                for key in ("self_cpu_s", f"server-{n}_cpu_s", "emulator_cpu_s"):
                    name = key.replace(f"-{n}", "")
                    row["cpu"][name] = row["cpu"].get(name, 0.0) + usage[key]
                print(f"N={n} rep {rep}: {len(result['latencies']) / result['wall_s']:.0f} turns/s")
    out = []
    for n, row in sorted(rows.items()):
        turns = max(len(row["latencies"]), 1)
        out.append(
            {
                "processes": n,
                "turns": len(row["latencies"]),
                "turns/s": len(row["latencies"]) / row["wall_s"],
                "p50 ms": ms(pct(row["latencies"], 50)),
                "p99 ms": ms(pct(row["latencies"], 99)),
                "server CPU ms/turn": ms(row["cpu"]["server_cpu_s"] / turns),
                "emulator CPU ms/turn": ms(row["cpu"]["emulator_cpu_s"] / turns),
                "load generator CPU ms/turn": ms(row["cpu"]["self_cpu_s"] / turns),
                "foreign cores": sum(row["foreign"]) / len(row["foreign"]),
                "errors": len(row["errors"]),
                "first error": row["errors"][0] if row["errors"] else "",
            }
        )
    print()
    print(load_average())
    print(table(out, [c for c in out[0] if c != "first error"]))
    for row in out:
        if row["errors"]:
            print(f"ERRORS with N={row['processes']}: {row['first error']}")
    write_json(
        args.json,
        {"args": {k: str(v) for k, v in vars(args).items()}, "load": load_average(), "rows": out},
    )


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--processes", type=lambda s: [int(x) for x in s.split(",")], default=[2])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--chats", type=int, default=2000, help="turns per run")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--completion-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    trio.run(main, parser.parse_args())
