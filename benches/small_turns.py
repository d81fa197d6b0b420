"""P2 small turns: latency the session server adds over talking to the worker directly.

Multi-turn sessions whose first prompt is ~``--prompt-tokens`` (1k) tokens and
whose every answer is exactly ``--completion-tokens`` (256) tokens; each later
turn appends a short user message. At each concurrency (``--concurrency``,
default 1,4,16,64) the same conversations run, alternating, ``--repeats``
times, ``--chats`` turns per run, along three paths:

- ``direct-ids``: the agent's request plus the ``input_ids`` (and forced fields)
  the server would send, tokenised by the load generator outside the timed
  call, so the emulator does exactly the work it does behind the server: the
  fair baseline;
- ``raw-ids``: that request through the no-parsing passthrough proxy
  (``benches/passthrough.py``): the cost of one more hypercorn + httpx hop;
- ``server``: through the session server.

(There is no path without ``input_ids``: the emulator refuses to render
``messages`` itself, as a session server's worker must never have to.)

With ``--compare-with DIR`` a fourth path, ``server-before``, runs a second
session server from the package exported at DIR (``git archive <commit>
rollout_session | tar -x -C DIR``; put first on its ``PYTHONPATH``; a git
revision is exported for you), alternating with the others: before/after
numbers from the same run, under the same machine load.

``--upstream replay`` puts the zero-cost replay worker (``benches/replay.py``)
behind every path instead of the emulator: one answer recorded from the
emulator, served for every turn at near-zero CPU, so the process in the
middle sets the pace and "server / raw throughput" compares the session server
with a proxy that does nothing but forward. With the emulator as the worker
(the default), its own CPU per turn paces both paths and the ratio says
little about the server.

``--system-tokens N`` puts a system prompt of ~N tokens, the same in every
session, before each first prompt (RL's shape: many episodes, one system
prompt).

Reported per concurrency: the server's throughput over the raw proxy's,
paired per repeat (each pair ran back to back; median and range of the
ratios); p50/p99 latency per path; "added" = server −
direct-ids (the issue's added latency), the raw proxy's own added latency for
comparison, and the in-server overhead paired per turn: agent-observed latency
minus the server's own ``upstream_latency_s`` for that turn (from the
trajectory), i.e. everything the server and its extra hop add, free of the
noise of comparing separate runs. CPU ms per turn of the server and the
emulator come from /proc. The emulator simulates no latency: every number is
CPU and loopback on the shared 2 cores.

    python benches/small_turns.py
    python benches/small_turns.py --concurrency 1,64 --profile prof/
    python benches/small_turns.py --compare-with /tmp/rs-before
    python benches/small_turns.py --upstream replay --concurrency 16 --compare-with main
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from _common import (
    AGENT_ANSWER,
    WORDS,
    Child,
    Window,
    agent_client,
    as_worker_request,
    bench_command,
    bench_parser,
    child,
    emulator_command,
    load_average,
    ms,
    package_at,
    pct,
    profile,
    pyplot,
    save_figure,
    server_command,
    table,
    tokenizer_path,
    write_json,
)

from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer

_FORCED = {"logprobs": True, "return_meta_info": True, "no_stop_trim": False, "stream": False}
MODES = ("direct-ids", "raw-ids", "server")
BEFORE = "server-before"


@functools.cache
def _tokenizer() -> ChatTokenizer:
    return load_tokenizer(tokenizer_path())


def first_prompt(tokens: int, salt: int) -> str:
    # One token per word with the bundled tokenizer; the template adds ~5.
    words = max(1, tokens - 8)
    return " ".join(WORDS[(i * 3 + salt) % len(WORDS)] for i in range(words))


@dataclass
class Run:
    latencies: list[float] = field(default_factory=list)
    # (session id, turn index, latency) for server runs
    turns: list[tuple[str, int, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)


async def conversation(
    client: httpx.AsyncClient,
    front: str,
    mode: str,
    index: int,
    args: argparse.Namespace,
    run: Run,
) -> None:
    through_server = mode in ("server", BEFORE)
    session_id = ""
    if through_server:
        created = await client.post(f"{front}/sessions")
        created.raise_for_status()
        session_id = created.json()["session_id"]
        run.sessions.append(session_id)
        url = f"{front}/sessions/{session_id}/v1/chat/completions"
    else:
        url = f"{front}/v1/chat/completions"
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": first_prompt(args.prompt_tokens, index)}
    ]
    if args.system_tokens:
        # One system prompt every episode shares, as in RL.
        messages.insert(0, {"role": "system", "content": first_prompt(args.system_tokens, 0)})
    for turn in range(args.turns):
        request: dict[str, Any] = {
            "messages": messages,
            "max_tokens": args.completion_tokens,
            "seed": index,
        }
        # What the server would send: the same work for the emulator. Built
        # on every path, used on two: at 4+ sessions this process's CPU
        # delays every agent's reading of its answer, so all paths pay it.
        input_ids = _tokenizer().first_turn(messages, tools=None, kwargs={})
        if mode in ("direct-ids", "raw-ids"):
            request |= _FORCED | {"input_ids": input_ids}
        body = orjson.dumps(request)
        started = time.perf_counter()
        response = await client.post(
            url, content=body, headers={"content-type": "application/json"}
        )
        latency = time.perf_counter() - started
        if response.status_code != 200:
            run.errors.append(f"{response.status_code}: {response.content[:200]!r}")
            return
        run.latencies.append(latency)
        if through_server:
            run.turns.append((session_id, turn, latency))
        content = AGENT_ANSWER.decode(response.content).choices[0].message.content
        messages = [
            *messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"Continue with step {turn}."},
        ]


async def run_once(front: str, mode: str, concurrency: int, args: argparse.Namespace) -> Run:
    run = Run()
    sessions = max(1, args.chats // args.turns)
    counter = itertools.count()

    async def agent() -> None:
        async with agent_client(timeout=300) as client:
            for index in counter:
                if index >= sessions:
                    return
                await conversation(client, front, mode, index, args, run)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(agent)
    return run


async def server_overheads(front: str, run: Run) -> list[float]:
    """Per turn: agent-observed latency minus the server's upstream latency."""
    upstream: dict[tuple[str, int], float] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for session_id in run.sessions:
            # v1's document, which server-before (an older package) answers
            # too: it ignores ?schema= and has the same fields at the top level.
            response = await client.delete(f"{front}/sessions/{session_id}", params={"schema": 1})
            response.raise_for_status()
            for turn in response.json()["turns"]:
                upstream[(session_id, turn["index"])] = turn["upstream_latency_s"]
    return [latency - upstream[(sid, i)] for sid, i, latency in run.turns if (sid, i) in upstream]


def _paired(ours: list[float], raw: list[float]) -> str:
    """Median and range of the per-repeat ratios (each pair ran back to back)."""
    ratios = sorted(a / b for a, b in zip(ours, raw, strict=True))
    if not ratios:
        return ""
    return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}–{ratios[-1]:.2f})"


async def measure(
    worker: Child,
    raw: Child,
    servers: dict[str, Child],
    concurrency: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    modes = [*MODES, *(m for m in servers if m not in MODES)]
    fronts = {**servers, "raw-ids": raw}
    latencies: dict[str, list[float]] = {mode: [] for mode in modes}
    worker_cpu = dict.fromkeys(modes, 0.0)
    overhead: dict[str, list[float]] = {mode: [] for mode in servers}
    # CPU of the process in the middle: each server's, and the raw proxy's.
    middle_cpu = dict.fromkeys([*servers, "raw-ids"], 0.0)
    # Turns per second of each run, by mode: throughput paired per repeat.
    throughput: dict[str, list[float]] = {mode: [] for mode in modes}
    errors: list[str] = []
    window = Window([worker, raw, *servers.values()])
    for rep in range(args.repeats):
        # The servers (the last of MODES, then server-before) swap places every
        # repetition: neither always runs right after the other.
        order = modes if rep % 2 == 0 else [*MODES[:2], *reversed(modes[2:])]
        for mode in order:
            front = fronts.get(mode, worker)
            # The server's profile, and the raw proxy's to hold it against.
            prof = (
                args.profile / f"p2-{mode}-c{concurrency}-r{rep}.txt"
                if args.profile and mode in ("server", "raw-ids")
                else None
            )
            before, before_middle = worker.cpu_s(), front.cpu_s()
            started = time.perf_counter()
            async with profile(front if prof else None, prof, rate=400):
                result = await run_once(front.url, mode, concurrency, args)
            throughput[mode].append(len(result.latencies) / (time.perf_counter() - started))
            worker_cpu[mode] += worker.cpu_s() - before
            latencies[mode] += result.latencies
            errors += result.errors
            if mode in middle_cpu:
                middle_cpu[mode] += front.cpu_s() - before_middle
            if mode in servers:
                overhead[mode] += await server_overheads(front.url, result)
    usage = window.finish()
    fair, proxied, through = (latencies[m] for m in MODES)
    n = {mode: max(len(v), 1) for mode, v in latencies.items()}
    row = {
        "concurrency": concurrency,
        "turns": len(through),
        "direct-ids p50 ms": ms(pct(fair, 50)),
        "direct-ids p99 ms": ms(pct(fair, 99)),
        "server p50 ms": ms(pct(through, 50)),
        "server p99 ms": ms(pct(through, 99)),
        "added p50 ms": ms(pct(through, 50) - pct(fair, 50)),
        "added p99 ms": ms(pct(through, 99) - pct(fair, 99)),
        "raw proxy added p50 ms": ms(pct(proxied, 50) - pct(fair, 50)),
        "raw proxy added p99 ms": ms(pct(proxied, 99) - pct(fair, 99)),
        "in-server p50 ms": ms(pct(overhead["server"], 50)),
        "in-server p99 ms": ms(pct(overhead["server"], 99)),
        "server CPU ms/turn": ms(middle_cpu["server"] / n["server"]),
        "raw proxy CPU ms/turn": ms(middle_cpu["raw-ids"] / n["raw-ids"]),
        "worker CPU ms/turn direct-ids": ms(worker_cpu["direct-ids"] / n["direct-ids"]),
        "worker CPU ms/turn via server": ms(worker_cpu["server"] / n["server"]),
        "server / raw throughput": _paired(throughput["server"], throughput["raw-ids"]),
        "foreign cores": usage["foreign_cores"],
        "errors": len(errors),
        "first error": errors[0] if errors else "",
    }
    if BEFORE in servers:
        row["before / raw throughput"] = _paired(throughput[BEFORE], throughput["raw-ids"])
        earlier = latencies[BEFORE]
        row |= {
            "before server p50 ms": ms(pct(earlier, 50)),
            "before added p50 ms": ms(pct(earlier, 50) - pct(fair, 50)),
            "before added p99 ms": ms(pct(earlier, 99) - pct(fair, 99)),
            "before in-server p50 ms": ms(pct(overhead[BEFORE], 50)),
            "before in-server p99 ms": ms(pct(overhead[BEFORE], 99)),
            "before server CPU ms/turn": ms(middle_cpu[BEFORE] / n[BEFORE]),
        }
    return row


_COLUMNS = [
    "concurrency",
    "turns",
    "direct-ids p50 ms",
    "direct-ids p99 ms",
    "server p50 ms",
    "server p99 ms",
    "added p50 ms",
    "added p99 ms",
    "raw proxy added p50 ms",
    "raw proxy added p99 ms",
    "in-server p50 ms",
    "in-server p99 ms",
]
_CPU_COLUMNS = [
    "concurrency",
    "server CPU ms/turn",
    "raw proxy CPU ms/turn",
    "worker CPU ms/turn direct-ids",
    "worker CPU ms/turn via server",
    "server / raw throughput",
    "foreign cores",
    "errors",
]
_BEFORE_COLUMNS = [
    "concurrency",
    "before added p50 ms",
    "added p50 ms",
    "before added p99 ms",
    "added p99 ms",
    "before in-server p50 ms",
    "in-server p50 ms",
    "before in-server p99 ms",
    "in-server p99 ms",
    "before server CPU ms/turn",
    "server CPU ms/turn",
    "before / raw throughput",
    "server / raw throughput",
]


async def main(args: argparse.Namespace) -> None:
    print(
        f"{load_average()}; worker: {args.upstream}; prompt ~{args.prompt_tokens} tokens "
        f"(+ a shared system prompt of ~{args.system_tokens}), {args.completion_tokens} "
        f"completion tokens, {args.turns} turns/session, {args.chats} turns per run"
    )
    rows = []
    async with (
        _worker(args) as worker,
        child(
            "server",
            server_command([worker.url], *args.server_flag),
            marker="rollout-session listening on",
        ) as server,
        child("raw", bench_command("passthrough.py", "--upstream", worker.url)) as raw,
        _before_server(worker, args) as before,
    ):
        servers = {"server": server, **({BEFORE: before} if before else {})}
        fronts = {**servers, "raw-ids": raw}
        warm = argparse.Namespace(**{**vars(args), "chats": 4 * args.turns})
        for mode in dict.fromkeys([*MODES, *servers]):
            await run_once(fronts.get(mode, worker).url, mode, 4, warm)
        for concurrency in args.concurrency:
            rows.append(await measure(worker, raw, servers, concurrency, args))
            print(table([rows[-1]], _COLUMNS), flush=True)
    print()
    print(load_average())
    print(table(rows, _COLUMNS))
    print()
    print(table(rows, _CPU_COLUMNS))
    if args.compare_with:
        print()
        print(f"server-before: the package at {args.compare_with}")
        print(table(rows, _BEFORE_COLUMNS))
    for row in rows:
        if row["errors"]:
            print(f"ERRORS at concurrency {row['concurrency']}: {row['first error']}")
    target = rows[0]["added p50 ms"] if rows else math.nan
    print(f"target: added p50 <= 2 ms (at concurrency {args.concurrency[0]}: {target:.2f} ms)")
    write_json(
        args.json,
        {"args": {k: str(v) for k, v in vars(args).items()}, "load": load_average(), "rows": rows},
    )
    if args.plot:
        plot(rows, args.plot)


@asynccontextmanager
async def _worker(args: argparse.Namespace) -> AsyncIterator[Child]:
    """The worker behind every path: the emulator, or the replay worker
    serving one answer recorded from it (its ids, logprobs and text as the
    emulator samples them for a first prompt of this size)."""
    flags = ["--completion-tokens", str(args.completion_tokens), "--record-limit", "0"]
    async with child("emulator", emulator_command(*flags)) as emulator:
        if args.upstream == "emulator":
            yield emulator
            return
        request = {
            "messages": [{"role": "user", "content": first_prompt(args.prompt_tokens, 0)}],
            "max_tokens": args.completion_tokens,
            "seed": 0,
        }
        async with httpx.AsyncClient(timeout=300) as client:
            response = await client.post(
                f"{emulator.url}/v1/chat/completions", json=as_worker_request(request)
            )
        response.raise_for_status()
    answer = Path(tempfile.mkdtemp(prefix="rollout-p2-")) / "answer.json"
    answer.write_bytes(response.content)
    command = bench_command("replay.py", "--answer", str(answer), "--tokenizer", tokenizer_path())
    async with child("replay", command) as replay:
        yield replay


@asynccontextmanager
async def _before_server(worker: Child, args: argparse.Namespace) -> AsyncIterator[Child | None]:
    if not args.compare_with:
        yield None
        return
    # `env` execs the server: the child's pid (and so its CPU) is the server's.
    command = [
        "env",
        f"PYTHONPATH={args.compare_with.resolve()}",
        *server_command([worker.url], *args.server_flag),
    ]
    async with child("server-before", command, marker="rollout-session listening on") as before:
        yield before


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["concurrency"] for r in rows]
    paths = (
        (
            "direct-ids p50 ms",
            "direct to the worker (with input_ids)",
            lambda r: r["direct-ids p50 ms"],
        ),
        (
            "raw",
            "through the raw passthrough proxy",
            lambda r: r["direct-ids p50 ms"] + r["raw proxy added p50 ms"],
        ),
        ("server p50 ms", "through the session server", lambda r: r["server p50 ms"]),
    )
    for _, label, value in paths:
        left.plot(xs, [value(r) for r in rows], "o-", label=label)
    left.set_title("per-turn latency p50", fontsize=10)
    for key, style in (("in-server p50 ms", "s-"), ("in-server p99 ms", "s--")):
        right.plot(xs, [r[key] for r in rows], style, label=key.replace(" ms", ""))
    right.plot(xs, [r["raw proxy added p50 ms"] for r in rows], "^:", label="raw proxy added p50")
    right.axhline(2, color="red", linestyle=":", linewidth=1, label="target p50 (2 ms)")
    right.set_title("server overhead per turn (latency - upstream latency)", fontsize=10)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("P2 small turns: 1k-token prompt, 256-token answers (2 shared cores)", fontsize=10)
    save_figure(fig, path)


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64]
    )
    parser.add_argument("--chats", type=int, default=256, help="turns per run")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument("--repeats", type=int, default=2, help="direct/server alternations")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument(
        "--system-tokens", type=int, default=0, help="a system prompt every session shares"
    )
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument(
        "--upstream",
        choices=("emulator", "replay"),
        default="emulator",
        help="the worker: the emulator, or the zero-cost replay of one recorded answer",
    )
    parser.add_argument(
        "--server-flag", action="append", default=[], help="extra flag for `serve` (repeatable)"
    )
    parser.add_argument(
        "--profile", type=Path, help="py-spy the server and the raw proxy into this dir"
    )
    parser.add_argument(
        "--compare-with",
        type=package_at,
        help="also run a server from the package exported at this dir (path server-before)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--from-json", type=Path, help="only re-plot a saved --json result")
    parsed = parser.parse_args()
    if parsed.from_json and parsed.plot:
        plot(json.loads(parsed.from_json.read_text())["rows"], parsed.plot)
    else:
        trio.run(main, parsed)
