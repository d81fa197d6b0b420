"""Start-up against many workers: ``--engine auto`` (every worker read once
before the pool starts) vs a named engine (the pool's admission alone).

A farm process (this script, ``--farm N``) hosts ``--workers`` (64) SGLang
emulators, each on its own loopback port, launched as a trainer launches
SGLang (``--tool-call-parser qwen25``). Against it, once per configuration
and repeat, a fresh ``serve --worker …`` (every emulator) is started and
timed from its spawn to:

- ``listening``: its "listening on" line (the start-up finished: engine
  chosen, tokenizer loaded, template checked);
- ``all admitted``: ``GET /health`` reports every worker healthy.

and its CPU seconds (process and children) at that point. Configurations:

- ``before``: the package at ``--compare-with`` (the commit before engines
  configured themselves: its default engine, ``sglang-chat``, admits by
  the pool's probes only);
- ``sglang-chat``: this tree, ``--engine sglang-chat`` (start-up reads the
  workers once as well: their parsers must agree);
- ``auto``: this tree's default (each worker probed as an SGLang and, where
  that fails, a vLLM worker; then admitted by the pool).

Configurations rotate order across ``--repeats`` (5); the median and range
are reported, with the ratio to ``before`` paired within each repeat.

Target: ``auto`` ≤ 2× ``before`` to ``all admitted``.

    python benches/startup.py --compare-with b34809e
    python benches/startup.py --compare-with b34809e --workers 16 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from _common import (
    Child,
    bench_command,
    bench_parser,
    child,
    load_average,
    package_at,
    proc_stats,
    server_command,
    table,
    write_json,
)

FARM_MARKER = "farm listening on"


async def farm(count: int) -> None:
    """`count` SGLang emulators in this process; prints their URLs, comma
    separated, on one line, then serves until killed."""
    from rollout_session.emulator import EmulatorConfig
    from rollout_session.emulator.app import start_emulator

    config = EmulatorConfig(tool_call_parser="qwen25")
    async with trio.open_nursery() as nursery:
        urls = []
        for _ in range(count):
            running, _ = await start_emulator(nursery, config, host="127.0.0.1")
            urls.append(running.url)
        print(f"{FARM_MARKER} {','.join(urls)}", flush=True)
        await trio.sleep_forever()


async def _all_admitted(client: httpx.AsyncClient, count: int) -> None:
    while True:
        try:
            health = (await client.get("/health")).json()
        except httpx.HTTPError:
            health = {}
        if health.get("workers", {}).get("healthy") == count:
            return
        await trio.sleep(0.01)


async def one_start(
    name: str, urls: list[str], flags: list[str], package: Path | None
) -> dict[str, float]:
    command = server_command(urls, *flags)
    if package is not None:
        command = ["env", f"PYTHONPATH={package}", *command]
    started = time.perf_counter()
    async with child(f"startup-{name}", command) as server:
        listening = time.perf_counter() - started
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            with trio.fail_after(120):
                await _all_admitted(client, len(urls))
        admitted = time.perf_counter() - started
        cpu = _cpu(server)
    return {"listening_s": listening, "admitted_s": admitted, "cpu_s": cpu}


def _cpu(server: Child) -> float:
    return server.cpu_s(proc_stats())


CONFIGS: dict[str, list[str]] = {
    "before": [],
    "sglang-chat": ["--engine", "sglang-chat"],
    "auto": [],
}


async def main(args: argparse.Namespace) -> None:
    print(f"load average before: {load_average()}", flush=True)
    async with child("farm", bench_command("startup.py", "--farm", str(args.workers)),
                     marker=FARM_MARKER, timeout_s=600) as farm_child:  # fmt: skip
        urls = farm_child.url.split(",")
        assert len(urls) == args.workers, urls
        names = list(CONFIGS)
        runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for repeat in range(args.repeats):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for name in order:
                package = args.compare_with if name == "before" else None
                result = await one_start(name, urls, CONFIGS[name], package)
                runs[name].append(result)
                print(f"repeat {repeat} {name}: {result}", flush=True)
    rows = []
    for name in names:
        row: dict[str, Any] = {"configuration": name}
        for key, label in (("listening_s", "listening s"), ("admitted_s", "all admitted s"),
                           ("cpu_s", "server CPU s")):  # fmt: skip
            values = [r[key] for r in runs[name]]
            row[label] = f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"
        ratios = [
            r["admitted_s"] / b["admitted_s"]
            for r, b in zip(runs[name], runs["before"], strict=True)
        ]
        row["× before (all admitted)"] = (
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"
        )
        rows.append(row)
    print(f"\n{args.workers} emulator workers, {args.repeats} repeats; load average after: "
          f"{load_average()}\n")  # fmt: skip
    print(table(rows))
    write_json(args.json, {"workers": args.workers, "runs": runs})


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare-with", type=package_at, default=None)
    parser.add_argument("--farm", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.farm is None and args.compare_with is None:
        parser.error("--compare-with REV is the baseline ('before'); e.g. b34809e")
    return args


if __name__ == "__main__":
    parsed = parse(sys.argv[1:])
    if parsed.farm is not None:
        trio.run(farm, parsed.farm)
    else:
        trio.run(main, parsed)
