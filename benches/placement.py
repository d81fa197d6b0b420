"""P5 placement: prefix-cache hits, load balance and rollout time per policy (issue 3).

For each policy (``--policies``: sticky-least-loaded, consistent-hash,
round-robin) the benchmark starts ``--workers`` (4) fresh emulator processes
with the prefix-cache model and simulated GPU time (a fixed cost per call, a
prefill cost per *uncached* prompt token, a decode cost per sampled token),
and a fresh session server with ``--placement POLICY`` in front of them. Then
``--agents`` (64) concurrent agents each run ``--turns`` (10) tool turns: a
shared system prompt and tool list (as in an RL task where every agent gets
the same instructions), a task of its own, and every turn a tool call answered
with a ~``--tool-result-words`` tool result. All workers use the same seed, so
the conversations are identical whichever worker serves a turn.

Reported per policy, from the sessions' trajectories (collected with DELETE)
and the pool's ``/workers``:

- cache-hit rate: sum of ``cached_tokens`` / sum of prompt tokens over all
  turns (first turns included), and the same over turns 2+; "history reuse":
  of the prompt tokens a session had already sent in earlier turns (its
  history), the share served from cache (turns 2+), which isolates placement
  from the tokens that are new in a turn and can never be cached ("history
  share": history / prompt tokens, the ceiling of the turns-2+ hit rate
  without cross-session sharing);
- load: max/mean over workers of the requests served, of the uncached
  (prefilled) tokens and of the sessions pinned;
- total rollout time (wall clock, all agents), and its ratio to round-robin;
- "model GPU s": the emulator's latency model summed over all turns (fixed +
  prefill x uncached tokens + decode x sampled tokens), i.e. the GPU time the
  policy costs, free of this machine's CPU limits, and its ratio to
  round-robin. The wall-clock ratio approaches it only when the simulated
  latencies dominate the CPU work of 4 emulators + server + agents on 2 cores
  (check ``ours cores``).

Targets (issue 3): sticky-least-loaded >= 90 % hits, max/mean <= 1.25, total
time <= 0.6x round-robin. The emulator models latency per request without
contention between requests (no batching limit), so the time ratio reflects
the prefill tokens saved, weighed by the configured prefill/decode costs.

    python benches/placement.py
    python benches/placement.py --prefill-s-per-token 0.0005 --plot docs/img/p5.png

Defaults: 0.1 s per call, 1 ms per uncached prompt token, 25 ms per sampled
token (a loaded GPU's share per request: prefill ~1k tokens/s, decode ~40
tokens/s), chosen so the simulated GPU time, not this machine's CPU, sets the
wall clock.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from _common import (
    Window,
    child,
    children,
    emulator_command,
    load_average,
    pyplot,
    server_command,
    table,
    write_json,
)

POLICIES = ("sticky-least-loaded", "consistent-hash", "round-robin")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_command",
            "description": "Run a shell command in the sandbox and return its output",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout_s": {"type": "integer"}},
                "required": ["command"],
            },
        },
    }
]
_WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "sigma", "model", "data")


def words(n: int, salt: int) -> str:
    return " ".join(_WORDS[(i * 7 + salt * 3 + i // 10) % len(_WORDS)] for i in range(n))


async def agent(
    client: httpx.AsyncClient, server: str, index: int, args: argparse.Namespace, out: list[str]
) -> None:
    created = await client.post(f"{server}/sessions", json={"metadata": {"agent": index}})
    created.raise_for_status()
    session_id = created.json()["session_id"]
    out.append(session_id)
    url = f"{server}/sessions/{session_id}/v1/chat/completions"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words(args.system_words, 0)},
        {"role": "user", "content": f"Task {index}: " + words(40, index)},
    ]
    for turn in range(args.turns):
        body = {
            "messages": messages,
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 256,
            "seed": index * 100 + turn,
        }
        response = await client.post(url, content=orjson.dumps(body))
        if response.status_code != 200:
            raise RuntimeError(f"agent {index} turn {turn}: {response.status_code} {response.text}")
        message = orjson.loads(response.content)["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        messages = [
            *messages,
            {"role": "assistant", "content": message.get("content"), "tool_calls": calls},
            {
                "role": "tool",
                "tool_call_id": calls[0]["id"] if calls else None,
                "content": words(args.tool_result_words, index * 31 + turn),
            },
        ]


def max_over_mean(values: list[float]) -> float:
    mean = statistics.fmean(values) if values else math.nan
    return max(values) / mean if mean else math.nan


async def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = [
        "--base-latency-s",
        str(args.base_latency_s),
        "--prefill-s-per-token",
        str(args.prefill_s_per_token),
        "--decode-s-per-token",
        str(args.decode_s_per_token),
        "--cache-capacity-tokens",
        str(args.cache_capacity_tokens),
        "--record-limit",
        "0",
        "--seed",
        "0",
    ]
    specs = [(f"worker{i}", emulator_command(*flags)) for i in range(args.workers)]
    async with children(specs) as workers:
        urls = [w.url for w in workers]
        async with child(
            "server",
            server_command(urls, "--placement", policy),
            marker="rollout-session listening on",
        ) as server:
            limits = httpx.Limits(max_connections=args.agents + 8)
            sessions: list[str] = []
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                started = time.perf_counter()
                window = Window([*workers, server])
                async with trio.open_nursery() as agents:
                    for index in range(args.agents):
                        agents.start_soon(agent, client, server.url, index, args, sessions)
                total_s = time.perf_counter() - started
                usage = window.finish()
                pool = (await client.get(f"{server.url}/workers")).json()
                documents = []
                for session_id in sessions:
                    response = await client.delete(f"{server.url}/sessions/{session_id}")
                    response.raise_for_status()
                    documents.append(orjson.loads(response.content))
                served = {}
                for w in workers:
                    stats = (await client.get(f"{w.url}/emulator/stats")).json()
                    served[w.url] = stats["completed"]

    prompt = cached = prompt_later = cached_later = history = reused = 0
    prefill: Counter[str] = Counter()
    gpu_s = 0.0  # the emulator's latency model summed over all turns
    for doc in documents:
        for turn in doc["turns"]:
            sent = turn["completion_start"]  # every token before the completion is sent
            hit = turn["cached_tokens"] or 0
            gpu_s += (
                args.base_latency_s
                + args.prefill_s_per_token * (sent - hit)
                + args.decode_s_per_token * (turn["completion_end"] - turn["completion_start"])
            )
            prompt += sent
            cached += hit
            prefill[turn["worker"]] += sent - hit
            if turn["index"]:
                prompt_later += sent
                cached_later += hit
                # The part of the prompt this session sent before (its history).
                history += turn["prompt_start"]
                reused += min(hit, turn["prompt_start"])
    pool_workers = pool.get("workers", pool) if isinstance(pool, dict) else pool
    pinned = [float(w.get("active_sessions", 0)) for w in pool_workers]
    return {
        "policy": policy,
        "turns": sum(len(d["turns"]) for d in documents),
        "hit %": 100 * cached / prompt,
        "hit % turns 2+": 100 * cached_later / max(prompt_later, 1),
        "history reuse %": 100 * reused / max(history, 1),
        "history share %": 100 * history / max(prompt_later, 1),
        "prefilled tokens": prompt - cached,
        "max/mean requests": max_over_mean([float(served[u]) for u in urls]),
        "max/mean prefill": max_over_mean([float(prefill[u]) for u in urls]),
        "max/mean pinned": max_over_mean(pinned) if any(pinned) else math.nan,
        "requests per worker": "/".join(str(served[u]) for u in urls),
        "total s": total_s,
        "model GPU s": gpu_s,
        "ours cores": usage["machine_cores"] - usage["foreign_cores"],
        "foreign cores": usage["foreign_cores"],
    }


async def main(args: argparse.Namespace) -> None:
    print(
        f"{load_average()}; {args.workers} workers, {args.agents} agents x {args.turns} tool "
        f"turns; base {args.base_latency_s} s, prefill {args.prefill_s_per_token} s/token, "
        f"decode {args.decode_s_per_token} s/token"
    )
    rows = []
    for policy in args.policies:
        rows.append(await run_policy(policy, args))
        print(table([rows[-1]], _COLUMNS), flush=True)
    baseline = next((r for r in rows if r["policy"] == "round-robin"), None)
    for row in rows:
        row["x round-robin"] = row["total s"] / baseline["total s"] if baseline else math.nan
        row["GPU s x round-robin"] = (
            row["model GPU s"] / baseline["model GPU s"] if baseline else math.nan
        )
    print()
    print(load_average())
    print(table(rows, _COLUMNS))
    print("targets (sticky-least-loaded): hit >= 90 %, max/mean <= 1.25, total <= 0.6x round-robin")
    write_json(
        args.json,
        {"args": {k: str(v) for k, v in vars(args).items()}, "load": load_average(), "rows": rows},
    )
    if args.plot:
        plot(rows, args.plot)


_COLUMNS = [
    "policy",
    "turns",
    "hit %",
    "hit % turns 2+",
    "history reuse %",
    "history share %",
    "prefilled tokens",
    "max/mean requests",
    "max/mean prefill",
    "max/mean pinned",
    "requests per worker",
    "total s",
    "x round-robin",
    "model GPU s",
    "GPU s x round-robin",
    "ours cores",
    "foreign cores",
]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    names = [r["policy"] for r in rows]
    colors = ["tab:green", "tab:blue", "tab:gray"][: len(rows)]
    panels = (
        ("hit %", "cache-hit rate %", 90, True),
        ("max/mean prefill", "max/mean prefilled tokens per worker", 1.25, False),
        ("x round-robin", "total rollout time / round-robin", 0.6, False),
    )
    for ax, (key, title, target, higher) in zip(axes, panels, strict=True):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.axhline(target, color="red", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(rows)), [n.replace("-", "-\n", 1) for n in names], fontsize=8)
        ax.set_title(f"{title}\n(target {'≥' if higher else '≤'} {target})", fontsize=9)
    fig.suptitle("P5 placement: 4 workers, 64 agents x 10 tool turns", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-words", type=int, default=1800, help="shared system prompt")
    parser.add_argument("--tool-result-words", type=int, default=200)
    # Simulated GPU time must dominate the CPU work of 4 emulators, the server
    # and 64 agents on 2 cores, or wall-clock time measures this machine's CPU.
    parser.add_argument("--base-latency-s", type=float, default=0.1)
    parser.add_argument("--prefill-s-per-token", type=float, default=0.001)
    parser.add_argument("--decode-s-per-token", type=float, default=0.025)
    parser.add_argument("--cache-capacity-tokens", type=int, default=1 << 20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    trio.run(main, parser.parse_args())
