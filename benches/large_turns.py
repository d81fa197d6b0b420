"""P1 large turns: chats/s and /health latency with ~1 MiB answers (issue 6).

K concurrent agents (default 64), each running fresh sessions of ``--turns``
turns (default 2: the second turn extends the first, exercising the
token-in/token-out append path), ``--rounds`` sessions per agent. Two answer
shapes (``--variants``):

- ``logprobs``: ``--completion-tokens`` (30k) sampled tokens per answer, so
  ~30k ``output_token_logprobs`` entries (~0.73 MiB with the emulator's entry
  format, which carries no token text; SGLang's with text is ~1.3 MiB);
- ``experts``: a 256-token answer plus a ``routed_experts`` blob of ~1.3 MiB
  (DeepSeek-V3 shape: 61 layers x top-8, ~530 positions per turn; the second
  turn asks only for its new positions with ``routed_experts_start_len``).

Three paths (``--targets``), each its own process on loopback, in one run:
``server`` (the session server: sessions via ``POST /sessions``), ``raw`` (the
no-parsing passthrough proxy in ``benches/passthrough.py``: the ceiling for the
stack) and ``direct`` (straight to the worker). ``raw-quart`` adds the same
proxy on Quart-Trio. ``/health`` of the path's front process is polled every
10 ms by a separate probe process during the measured window.

Two upstreams (``--upstreams``): ``emulator`` (the real `rollout-session
emulator`; it needs 100-200 ms of CPU per 30k-token answer, so on 2 cores it is
the bottleneck of every path) and ``replay`` (``benches/replay.py`` serving an
answer recorded from that emulator at near-zero CPU, so the numbers show the
process in the middle). CPU per chat of every process is read from /proc.
Targets run interleaved ``--repeats`` times (replay; ``--emulator-repeats``
for the slow emulator upstream); the table shows the median run by chats/s
with the range, the JSON keeps every run.

``--close``: after the measured turns, the server paths collect every
session of the run with ``DELETE`` (K trainers at a time, one connection
each), in a window of their own: bytes per session, DELETE latency, the
server's CPU per DELETE, ``/health`` during the DELETEs, and the server's
peak RSS over the whole run (medians over the repeats). ``--compare-with
DIR`` adds the path ``server-before``: a session server from the package
exported at DIR (``git archive <commit> rollout_session | tar -x -C DIR``,
put first on its ``PYTHONPATH``), interleaved with the others, so before
and after come from the same run under the same machine load.

    python benches/large_turns.py                       # both variants and upstreams
    python benches/large_turns.py --variants logprobs --upstreams replay --profile prof/
    python benches/large_turns.py --variants logprobs --upstreams replay --targets server \
        --close --compare-with /tmp/rs-before
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import tempfile
import time
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
    WorkerConversation,
    agent_client,
    as_worker_request,
    bench_command,
    bench_parser,
    child,
    emulator_command,
    health_probe,
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

TARGETS = ("server", "server-before", "raw", "raw-quart", "direct")
# The paths that are session servers: they have sessions to collect.
SERVERS = ("server", "server-before")


def padding(words: int, salt: int) -> str:
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(words))


@dataclass
class Variant:
    name: str
    emulator_flags: list[str]
    first_message: Any  # (agent, round) -> str
    follow_up: Any  # (agent, round, turn) -> str
    extra: dict[str, Any]
    routed: bool = False
    max_tokens: int = 0
    server_flags: tuple[str, ...] = ()


def variants(args: argparse.Namespace) -> dict[str, Variant]:
    logprobs = Variant(
        name="logprobs",
        emulator_flags=[
            "--completion-tokens",
            str(args.completion_tokens),
            "--context-length",
            str(args.context_length),
        ],
        first_message=lambda a, r: f"Write a very long essay, agent {a} round {r}.",
        follow_up=lambda a, r, t: f"Continue from step {t}.",
        extra={},
        max_tokens=args.completion_tokens,
    )
    experts = Variant(
        name="experts",
        emulator_flags=[
            "--completion-tokens",
            str(args.experts_completion_tokens),
            "--routed-experts-layers",
            str(args.experts_layers),
            "--routed-experts-top-k",
            str(args.experts_top_k),
            "--routed-experts-num-experts",
            "256",
            "--context-length",
            str(args.context_length),
        ],
        first_message=lambda a, r: padding(args.experts_prompt_words, a * 31 + r),
        # As long as the first: every turn's blob covers ~the same positions.
        follow_up=lambda a, r, t: padding(args.experts_prompt_words, a * 31 + r + t + 1),
        extra={"return_routed_experts": True},
        routed=True,
        max_tokens=args.experts_completion_tokens,
        # R3: the server asks for (only the new positions' experts) and stores them.
        server_flags=("--routed-experts",),
    )
    return {v.name: v for v in (logprobs, experts)}


@dataclass
class Load:
    latencies: list[float] = field(default_factory=list)
    bytes_in: int = 0
    errors: list[str] = field(default_factory=list)
    chats: int = 0
    sessions: list[str] = field(default_factory=list)  # server paths: to collect


async def agent(
    front: str,
    mode: str,
    variant: Variant,
    agent_id: int,
    rounds: range,
    turns: int,
    load: Load,
) -> None:
    async with agent_client(timeout=900) as client:
        for r in rounds:
            if mode == "server":
                created = await client.post(f"{front}/sessions")
                created.raise_for_status()
                url = f"{front}{created.json()['base_url']}/chat/completions"
                load.sessions.append(created.json()["session_id"])
            else:
                url = f"{front}/v1/chat/completions"
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": variant.first_message(agent_id, r)}
            ]
            forwarded = 0
            direct = WorkerConversation()
            for turn in range(turns):
                body: dict[str, Any] = {
                    "messages": messages,
                    "max_tokens": variant.max_tokens,
                    "seed": agent_id * 1000 + r * 10 + turn,
                    **variant.extra,
                }
                if variant.routed and turn:
                    body["routed_experts_start_len"] = forwarded
                if mode != "server":
                    # What the server would send, built as it builds it: the
                    # worker never renders.
                    body = direct.request(body)
                started = time.perf_counter()
                response = await client.post(
                    url, content=orjson.dumps(body), headers={"content-type": "application/json"}
                )
                load.latencies.append(time.perf_counter() - started)
                load.chats += 1
                load.bytes_in += len(response.content)
                if response.status_code != 200:
                    load.errors.append(f"{response.status_code}: {response.content[:200]!r}")
                    break
                answer = AGENT_ANSWER.decode(response.content)
                if mode != "server":
                    direct.answered(response.content)
                forwarded = answer.usage.prompt_tokens + answer.usage.completion_tokens
                messages = [
                    *messages,
                    {"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": variant.follow_up(agent_id, r, turn)},
                ]


async def run_load(
    front: str, mode: str, variant: Variant, agents: int, rounds: range, turns: int
) -> Load:
    load = Load()
    async with trio.open_nursery() as nursery:
        for a in range(agents):
            nursery.start_soon(agent, front, mode, variant, a, rounds, turns, load)
    return load


async def record_answer(worker: str, variant: Variant, path: Path) -> int:
    body = {
        "messages": [{"role": "user", "content": variant.first_message(0, 0)}],
        "max_tokens": variant.max_tokens,
        "seed": 1,
        **variant.extra,
    }
    async with httpx.AsyncClient(timeout=300) as client:
        response = await client.post(f"{worker}/v1/chat/completions", json=as_worker_request(body))
    response.raise_for_status()
    await trio.Path(path).write_bytes(response.content)
    return len(response.content)


@dataclass
class Collection:
    latencies: list[float] = field(default_factory=list)
    bytes_in: int = 0
    errors: list[str] = field(default_factory=list)


async def collect(front: str, session_ids: list[str], trainers: int) -> Collection:
    """DELETE every session, `trainers` at a time, each with its own connection."""
    done = Collection()
    pending = iter(session_ids)

    async def trainer() -> None:
        async with agent_client(timeout=900) as client:
            for session_id in pending:
                started = time.perf_counter()
                response = await client.delete(f"{front}/sessions/{session_id}")
                done.latencies.append(time.perf_counter() - started)
                done.bytes_in += len(response.content)
                if response.status_code != 200:
                    done.errors.append(f"{response.status_code}: {response.content[:200]!r}")

    async with trio.open_nursery() as nursery:
        for _ in range(min(trainers, len(session_ids))):
            nursery.start_soon(trainer)
    return done


async def measure_close(
    args: argparse.Namespace, server: Child, session_ids: list[str]
) -> dict[str, Any]:
    """The DELETE window: every session of the measured run collected."""
    async with health_probe(server.url, args.health_interval_s) as probe:
        window = Window([server, probe.process])
        done = await collect(server.url, session_ids, args.sessions)
        usage = window.finish()
    n = max(len(done.latencies), 1)
    return {
        "sessions closed": len(done.latencies),
        "KiB/session": done.bytes_in / n / 1024,
        "delete p50 ms": ms(pct(done.latencies, 50)),
        "delete p99 ms": ms(pct(done.latencies, 99)),
        "delete CPU ms/session": ms(usage[f"{server.name}_cpu_s"] / n),
        "delete loop CPU ms/session": ms(usage[f"{server.name}_main_cpu_s"] / n),
        "delete health p99 ms": ms(pct(probe.latencies, 99)),
        "delete errors": len(done.errors),
        "first delete error": done.errors[0] if done.errors else "",
    }


def front_process(target: str, upstream: Child, variant: Variant, args: argparse.Namespace) -> Any:
    """The process agents talk to for `target` (a context manager; None = direct)."""
    if target in SERVERS:
        command = server_command([upstream.url], *variant.server_flags, *args.server_flag)
        if target == "server-before":
            # `env` execs the server: the child's pid (and so its CPU) is the server's.
            command = ["env", f"PYTHONPATH={args.compare_with.resolve()}", *command]
        return child(target, command, marker="rollout-session listening on")
    if target.startswith("raw"):
        framework = "quart" if target == "raw-quart" else "asgi"
        command = bench_command(
            "passthrough.py", "--upstream", upstream.url, "--framework", framework
        )
        return child(target, command)
    return contextlib.nullcontext()


async def measure(
    args: argparse.Namespace,
    variant: Variant,
    upstream_name: str,
    upstream: Child,
    target: str,
) -> dict[str, Any]:
    async with front_process(target, upstream, variant, args) as front_child:
        front = front_child.url if front_child else upstream.url
        mode = "server" if target in SERVERS else "plain"
        # Warm-up: connections, tokenizer caches, first-call imports.
        warm = await run_load(front, mode, variant, min(16, args.sessions), range(1), args.turns)
        if args.close and mode == "server":
            await collect(front, warm.sessions, args.sessions)  # and the DELETE path
        measured = front_child or upstream
        rounds = range(1, 1 + args.rounds)
        prof_path = (
            args.profile / f"p1-{variant.name}-{upstream_name}-{target}.txt"
            if args.profile and front_child is not None
            else None
        )
        async with health_probe(measured.url, args.health_interval_s) as probe:
            processes = [measured, probe.process] + ([upstream] if front_child else [])
            window = Window(processes)
            async with profile(front_child, prof_path):
                load = await run_load(front, mode, variant, args.sessions, rounds, args.turns)
            usage = window.finish()
        health = probe.latencies
        rss, peak = measured.memory_mib()
        closed: dict[str, Any] = {}
        if args.close and mode == "server" and front_child is not None:
            closed = await measure_close(args, front_child, load.sessions)
            closed["run peak MiB"] = front_child.memory_mib()[1]
    chats = load.chats
    wall = usage["wall_s"]
    return {
        "variant": variant.name,
        "upstream": upstream_name,
        "target": target,
        "chats": chats,
        "errors": len(load.errors),
        "chats/s": chats / wall,
        "MiB/answer": load.bytes_in / chats / 2**20,
        "health p50 ms": ms(pct(health, 50)),
        "health p95 ms": ms(pct(health, 95)),
        "health p99 ms": ms(pct(health, 99)),
        "health max ms": ms(max(health, default=math.nan)),
        "health n": len(health),
        "chat p50 ms": ms(pct(load.latencies, 50)),
        "chat p99 ms": ms(pct(load.latencies, 99)),
        "front CPU ms/chat": ms(usage[f"{measured.name}_cpu_s"] / chats)
        if front_child
        else math.nan,
        # The front process alone: for the server, its event loop without
        # the validation processes (what bounds it where those have cores).
        "front loop CPU ms/chat": ms(usage[f"{measured.name}_main_cpu_s"] / chats)
        if front_child
        else math.nan,
        "worker CPU ms/chat": ms(usage[f"{upstream.name}_cpu_s"] / chats),
        "client CPU ms/chat": ms(usage["self_cpu_s"] / chats),
        "foreign cores": usage["foreign_cores"],
        "front RSS MiB": rss if front_child else math.nan,
        "front peak MiB": peak if front_child else math.nan,
        "first error": load.errors[0] if load.errors else "",
        **closed,
    }


async def main(args: argparse.Namespace) -> None:
    print(
        f"{load_average()}; K={args.sessions} agents x {args.rounds} sessions x {args.turns} turns"
    )
    all_variants = variants(args)
    runs: list[dict[str, Any]] = []

    async def measure_targets(variant: Variant, upstream_name: str, upstream: Child) -> None:
        # Targets interleaved, `repeats` times: drift hits every target alike.
        repeats = args.emulator_repeats if upstream_name == "emulator" else args.repeats
        for _ in range(repeats):
            for target in args.targets:
                runs.append(await measure(args, variant, upstream_name, upstream, target))
                print(table([runs[-1]], _COLUMNS), flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="rollout-p1-"))
    for variant_name in args.variants:
        variant = all_variants[variant_name]
        for upstream_name in args.upstreams:
            async with child(
                "emulator", emulator_command(*variant.emulator_flags, "--record-limit", "0")
            ) as emulator:
                if upstream_name == "emulator":
                    await measure_targets(variant, upstream_name, emulator)
                    continue
                answer = workdir / f"{variant.name}.json"
                size = await record_answer(emulator.url, variant, answer)
            print(f"recorded {variant.name} answer: {size / 2**20:.2f} MiB")
            replay_cmd = bench_command(
                "replay.py", "--answer", str(answer), "--tokenizer", tokenizer_path()
            )
            async with child("replay", replay_cmd) as replay:
                await measure_targets(variant, upstream_name, replay)
    rows = median_runs(runs)
    for row in rows:
        raw = next(
            (
                r
                for r in rows
                if r["target"] == "raw"
                and r["variant"] == row["variant"]
                and r["upstream"] == row["upstream"]
            ),
            None,
        )
        row["x raw"] = row["chats/s"] / raw["chats/s"] if raw else math.nan
    print()
    print(load_average())
    print(table(rows, _COLUMNS))
    print()
    print(table(rows, _CPU_COLUMNS))
    closing = [r for r in rows if "sessions closed" in r]
    if closing:
        print()
        print(f"DELETE of every session (medians of {args.repeats} runs)")
        print(table(closing, _CLOSE_COLUMNS))
    errors = [r for r in rows if r["errors"] or r.get("delete errors")]
    for r in errors:
        first = r["first error"] or r.get("first delete error")
        print(f"ERRORS in {r['variant']}/{r['upstream']}/{r['target']}: {first}")
    write_json(
        args.json, {"args": _jsonable(args), "load": load_average(), "rows": rows, "runs": runs}
    )
    if args.plot:
        plot(rows, args.plot)


_COLUMNS = [
    "variant",
    "upstream",
    "target",
    "chats",
    "chats/s",
    "x raw",
    "runs",
    "chats/s range",
    "MiB/answer",
    "health p50 ms",
    "health p95 ms",
    "health p99 ms",
    "health max ms",
    "health p99 range",
    "chat p50 ms",
    "chat p99 ms",
]
_CPU_COLUMNS = [
    "variant",
    "upstream",
    "target",
    "front CPU ms/chat",
    "front loop CPU ms/chat",
    "worker CPU ms/chat",
    "client CPU ms/chat",
    "front RSS MiB",
    "front peak MiB",
    "foreign cores",
    "errors",
]


_CLOSE_COLUMNS = [
    "variant",
    "upstream",
    "target",
    "sessions closed",
    "KiB/session",
    "delete p50 ms",
    "delete p99 ms",
    "delete CPU ms/session",
    "delete CPU range",
    "delete loop CPU ms/session",
    "delete health p99 ms",
    "run peak MiB",
    "delete errors",
]
# Medians over the repeats, each on its own (not the median run by chats/s).
_CLOSE_MEDIANS = [c for c in _CLOSE_COLUMNS[4:] if c not in ("delete CPU range", "delete errors")]


def median_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (variant, upstream, target): the run with the median chats/s,
    plus the spread over the repeats (the DELETE window's figures: medians)."""
    rows = []
    keys = dict.fromkeys((r["variant"], r["upstream"], r["target"]) for r in runs)
    for key in keys:
        group = sorted(
            (r for r in runs if (r["variant"], r["upstream"], r["target"]) == key),
            key=lambda r: r["chats/s"],
        )
        row = dict(group[(len(group) - 1) // 2])
        row["runs"] = len(group)
        row["errors"] = sum(r["errors"] for r in group)
        row["chats/s range"] = f"{group[0]['chats/s']:.1f}-{group[-1]['chats/s']:.1f}"
        row["health p99 range"] = (
            f"{min(r['health p99 ms'] for r in group):.0f}-"
            f"{max(r['health p99 ms'] for r in group):.0f}"
        )
        if "sessions closed" in row:
            for column in _CLOSE_MEDIANS:
                row[column] = statistics.median(r[column] for r in group)
            cpu = [r["delete CPU ms/session"] for r in group]
            row["delete CPU range"] = f"{min(cpu):.0f}-{max(cpu):.0f}"
            row["delete errors"] = sum(r["delete errors"] for r in group)
        rows.append(row)
    return rows


def _jsonable(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    groups = sorted({(r["variant"], r["upstream"]) for r in rows})
    targets = [t for t in TARGETS if any(r["target"] == t for r in rows)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(targets)
    for i, target in enumerate(targets):
        xs, rates, p99 = [], [], []
        for g, (variant, upstream) in enumerate(groups):
            row = next(
                (
                    r
                    for r in rows
                    if (r["variant"], r["upstream"], r["target"]) == (variant, upstream, target)
                ),
                None,
            )
            if row:
                xs.append(g + i * width)
                rates.append(row["chats/s"])
                p99.append(row["health p99 ms"])
        ax1.bar(xs, rates, width, label=target)
        ax2.bar(xs, p99, width, label=target)
    labels = [f"{v}\n{u}" for v, u in groups]
    for ax, title in ((ax1, "chats/s (higher is better)"), (ax2, "/health p99 ms under load")):
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], labels)
        ax.set_title(title)
        ax.legend()
    ax2.axhline(50, color="red", linestyle="--", linewidth=1)
    ax2.set_yscale("log")
    fig.suptitle("P1 large turns: K=64 sessions, ~0.7-1.3 MiB answers")
    save_figure(fig, path)


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--sessions", type=int, default=64, help="K concurrent agents")
    parser.add_argument("--rounds", type=int, default=2, help="fresh sessions per agent")
    parser.add_argument("--turns", type=int, default=2, help="turns per session")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per target (replay upstream); median shown"
    )
    parser.add_argument(
        "--emulator-repeats", type=int, default=1, help="runs per target (emulator upstream)"
    )
    parser.add_argument("--variants", type=lambda s: s.split(","), default=["logprobs", "experts"])
    parser.add_argument("--upstreams", type=lambda s: s.split(","), default=["replay", "emulator"])
    parser.add_argument(
        "--targets", type=lambda s: s.split(","), default=["server", "raw", "direct"]
    )
    parser.add_argument("--completion-tokens", type=int, default=30000)
    parser.add_argument("--context-length", type=int, default=131072)
    parser.add_argument("--experts-completion-tokens", type=int, default=256)
    parser.add_argument("--experts-prompt-words", type=int, default=260)
    parser.add_argument("--experts-layers", type=int, default=61)
    parser.add_argument("--experts-top-k", type=int, default=8)
    parser.add_argument("--health-interval-s", type=float, default=0.01)
    parser.add_argument(
        "--server-flag", action="append", default=[], help="extra flag for `serve` (repeatable)"
    )
    parser.add_argument("--profile", type=Path, help="py-spy the server/raw proxy into this dir")
    parser.add_argument(
        "--close", action="store_true", help="then DELETE every session, in a window of its own"
    )
    parser.add_argument(
        "--compare-with",
        type=package_at,
        help="also run a server from the package exported at this dir (path server-before)",
    )
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--plot", type=Path, help="write a PNG here")
    parsed = parser.parse_args()
    if parsed.compare_with and "server-before" not in parsed.targets:
        # Right after the server: the two alternate in every repeat.
        at = parsed.targets.index("server") + 1 if "server" in parsed.targets else 0
        parsed.targets.insert(at, "server-before")
    elif "server-before" in parsed.targets and not parsed.compare_with:
        parser.error("the server-before path needs --compare-with DIR")
    trio.run(main, parsed)
