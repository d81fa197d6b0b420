"""P5 placement: prefix-cache hits, load balance and rollout time per policy (issue 3).

For each workload (``--workloads``), GPU model (``--models``) and policy
(``--policies``: sticky-least-loaded, consistent-hash, round-robin) the
benchmark starts ``--workers`` (4) fresh emulator processes with the
prefix-cache model and simulated GPU time, and a fresh session server with
``--placement POLICY`` in front of them. Then ``--agents`` (64) concurrent
agents each run ``--turns`` (10) tool turns: a shared system prompt and tool
list (every agent of an RL task gets the same instructions), a task of its
own, and every turn a tool call answered with a tool result. All workers use
the same seed, so the conversations are identical whichever worker serves a
turn.

Workloads (sizes in words; a generated word is about one token):

- ``v1``: the first P5 workload: 1,800-word system prompt, one small tool,
  40-word task, 200-word tool results;
- ``agentic`` (modelled on OpenHands' CodeAct agent, docs/performance.md#p5-placement):
  1,300-word system prompt, five tools with long descriptions (~2.2k tokens of
  tool JSON), 250-word task, tool results cycling through 80..1,200 words
  (mean 478 words, 448 tokens).

GPU models (the emulator's ``--gpu-contention``, see docs/emulator.md):

- ``independent``: every request sleeps base + prefill x uncached + decode x
  sampled on its own (no contention), at ``--prefill-s-per-token``
  (default 1 ms: "a loaded GPU's share per request");
- ``contention``: one GPU per worker; prefill serialised in arrival order and
  stalling the batched decode, at ``--gpu-prefill-s-per-token`` (default
  0.1 ms: the whole GPU's prefill rate, ~10k tokens/s).

Both use ``--base-latency-s`` (0.1 s, outside the GPU) and
``--decode-s-per-token`` (25 ms: one batched decode step).

Reported per run, from the sessions' trajectories (collected with DELETE),
the pool's ``/workers`` and the emulators' ``/emulator/stats``:

- cache-hit rate: sum of ``cached_tokens`` / sum of prompt tokens over all
  turns (first turns included), and the same over turns 2+; "history reuse":
  of the prompt tokens a session had already sent in earlier turns (its
  history), the share served from cache (turns 2+), which isolates placement
  from the tokens that are new in a turn and can never be cached ("history
  share": history / prompt tokens, the ceiling of the turns-2+ hit rate
  without cross-session sharing);
- load: max/mean over workers of the requests served, of the uncached
  (prefilled) tokens and of the sessions pinned;
- total rollout time (wall clock, all agents), and its ratio to round-robin
  of the same workload and model;
- ``independent``: "model GPU s", the latency model summed over all turns and
  its ratio to round-robin (GPU time free of this machine's CPU limits);
  ``contention``: "max GPU busy s", the busiest worker's GPU time (prefill +
  decode steps), which bounds the rollout from below.

Targets (issue 3): sticky-least-loaded >= 90 % hits, max/mean <= 1.25, total
time <= 0.6x round-robin.

    python benches/placement.py
    python benches/placement.py --workloads v1 --models contention --agents 16 --turns 4
    python benches/placement.py --json p5.json --plot docs/img/p5_placement.png
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from _common import (
    WORDS,
    Window,
    after_tool_call,
    bench_parser,
    child,
    children,
    emulator_command,
    load_average,
    pyplot,
    save_figure,
    server_command,
    table,
    write_json,
)

POLICIES = ("sticky-least-loaded", "consistent-hash", "round-robin")
MODELS = ("independent", "contention")


def words(n: int, salt: int) -> str:
    return " ".join(WORDS[(i * 7 + salt * 3 + i // 10) % len(WORDS)] for i in range(n))


def tool(name: str, description_words: int, params: dict[str, int]) -> dict[str, Any]:
    """A function tool with a description and string parameters of the given sizes."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": words(description_words, len(name)),
            "parameters": {
                "type": "object",
                "properties": {
                    p: {"type": "string", "description": words(n, len(p))}
                    for p, n in params.items()
                },
                "required": list(params)[:1],
            },
        },
    }


@dataclass(frozen=True)
class Workload:
    system_words: int
    tools: list[dict[str, Any]]
    task_words: int
    # Tool-result sizes, cycled over turns (each agent starts at its own offset).
    result_words: tuple[int, ...]


WORKLOADS = {
    "v1": Workload(
        system_words=1800,
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "run_command",
                    "description": "Run a shell command in the sandbox and return its output",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "command": {"type": "string"},
                            "timeout_s": {"type": "integer"},
                        },
                        "required": ["command"],
                    },
                },
            }
        ],
        task_words=40,
        result_words=(200,),
    ),
    # OpenHands CodeAct-like: its system prompt (~5.7k characters) and tool
    # schemas (execute_bash, str_replace_editor, think, finish, task_tracker:
    # ~10k characters of descriptions); a SWE-bench-sized issue as the task;
    # tool results from a short `ls` to a 100-line file view, below
    # mini-swe-agent's 10k-character output cap.
    "agentic": Workload(
        system_words=1300,
        tools=[
            tool("execute_bash", 300, {"command": 60, "is_input": 30, "timeout": 20}),
            tool(
                "str_replace_editor",
                450,
                {
                    "command": 20,
                    "path": 15,
                    "file_text": 15,
                    "old_str": 15,
                    "new_str": 30,
                    "insert_line": 20,
                    "view_range": 60,
                },
            ),
            tool("think", 120, {"thought": 10}),
            tool("finish", 80, {"message": 15}),
            tool("task_tracker", 350, {"command": 40, "task_list": 60}),
        ],
        task_words=250,
        result_words=(80, 400, 1200, 150, 600, 250, 900, 100, 500, 300),
    ),
}


async def agent(
    client: httpx.AsyncClient, server: str, index: int, work: Workload, turns: int, out: list[str]
) -> None:
    created = await client.post(f"{server}/sessions", json={"metadata": {"agent": index}})
    created.raise_for_status()
    session_id = created.json()["session_id"]
    out.append(session_id)
    url = f"{server}/sessions/{session_id}/v1/chat/completions"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words(work.system_words, 0)},
        {"role": "user", "content": f"Task {index}: " + words(work.task_words, index)},
    ]
    for turn in range(turns):
        body = {
            "messages": messages,
            "tools": work.tools,
            "tool_choice": "required",
            "max_tokens": 256,
            "seed": index * 100 + turn,
        }
        response = await client.post(url, content=orjson.dumps(body))
        if response.status_code != 200:
            raise RuntimeError(f"agent {index} turn {turn}: {response.status_code} {response.text}")
        result = words(
            work.result_words[(index + turn) % len(work.result_words)], index * 31 + turn
        )
        messages = after_tool_call(messages, response.content, result)


def max_over_mean(values: list[float]) -> float:
    mean = statistics.fmean(values) if values else math.nan
    return max(values) / mean if mean else math.nan


async def run_policy(
    workload: str, model: str, policy: str, args: argparse.Namespace
) -> dict[str, Any]:
    contention = model == "contention"
    prefill_s = args.gpu_prefill_s_per_token if contention else args.prefill_s_per_token
    flags = [
        "--base-latency-s",
        str(args.base_latency_s),
        "--prefill-s-per-token",
        str(prefill_s),
        "--decode-s-per-token",
        str(args.decode_s_per_token),
        "--cache-capacity-tokens",
        str(args.cache_capacity_tokens),
        "--record-limit",
        "0",
        "--seed",
        "0",
        *(["--gpu-contention"] if contention else []),
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
                        agents.start_soon(
                            agent, client, server.url, index, WORKLOADS[workload], args.turns,
                            sessions,
                        )  # fmt: skip
                total_s = time.perf_counter() - started
                usage = window.finish()
                pool = (await client.get(f"{server.url}/workers")).json()
                documents = []
                for session_id in sessions:
                    # v1's document: one segment per session here.
                    response = await client.delete(
                        f"{server.url}/sessions/{session_id}", params={"schema": 1}
                    )
                    response.raise_for_status()
                    documents.append(orjson.loads(response.content))
                served, busy = {}, {}
                for w in workers:
                    stats = (await client.get(f"{w.url}/emulator/stats")).json()
                    served[w.url] = stats["completed"]
                    gpu = stats.get("gpu", {})
                    busy[w.url] = gpu.get("prefill_busy_s", 0.0) + gpu.get("decode_busy_s", 0.0)

    prompt = cached = prompt_later = cached_later = history = reused = 0
    prefill: Counter[str] = Counter()
    gpu_s = 0.0  # the emulator's latency model summed over all turns
    for doc in documents:
        for turn in doc["turns"]:
            sent = turn["completion_start"]  # every token before the completion is sent
            hit = turn["cached_tokens"] or 0
            gpu_s += (
                args.base_latency_s
                + prefill_s * (sent - hit)
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
        "workload": workload,
        "model": model,
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
        "model GPU s": math.nan if contention else gpu_s,
        "max GPU busy s": max(busy.values()) if contention else math.nan,
        "ours cores": usage["machine_cores"] - usage["foreign_cores"],
        "foreign cores": usage["foreign_cores"],
    }


async def main(args: argparse.Namespace) -> None:
    print(
        f"{load_average()}; {args.workers} workers, {args.agents} agents x {args.turns} tool "
        f"turns; base {args.base_latency_s} s, prefill {args.prefill_s_per_token} s/token "
        f"(contention: {args.gpu_prefill_s_per_token}), decode {args.decode_s_per_token} s/token"
    )
    rows = []
    for workload in args.workloads:
        for model in args.models:
            group = []
            for policy in args.policies:
                group.append(await run_policy(workload, model, policy, args))
                print(table([group[-1]], _COLUMNS), flush=True)
            ratios(group)
            rows += group
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


def ratios(group: list[dict[str, Any]]) -> None:
    """Wall-clock and GPU-time ratios to round-robin, within one workload and model."""
    base = next((r for r in group if r["policy"] == "round-robin"), None)
    gpu = "max GPU busy s" if group[0]["model"] == "contention" else "model GPU s"
    for row in group:
        row["x round-robin"] = row["total s"] / base["total s"] if base else math.nan
        row["GPU x round-robin"] = row[gpu] / base[gpu] if base else math.nan


_COLUMNS = [
    "workload",
    "model",
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
    "max GPU busy s",
    "GPU x round-robin",
    "ours cores",
    "foreign cores",
]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    groups = list(dict.fromkeys((r["workload"], r["model"]) for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    colors = dict(zip(POLICIES, ("tab:green", "tab:blue", "tab:gray"), strict=True))
    width = 0.8 / len(policies)
    panels = (
        ("hit %", "cache-hit rate %", 90, True),
        ("max/mean prefill", "max/mean prefilled tokens per worker", 1.25, False),
        ("x round-robin", "total rollout time / round-robin", 0.6, False),
    )
    for ax, (key, title, target, higher) in zip(axes, panels, strict=True):
        for k, policy in enumerate(policies):
            values = [
                next((r[key] for r in rows if (r["workload"], r["model"]) == g
                      and r["policy"] == policy), math.nan)
                for g in groups
            ]  # fmt: skip
            xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, values, width, color=colors.get(policy), label=policy)
        ax.axhline(target, color="red", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(groups)), [f"{w}\n{m}" for w, m in groups], fontsize=8)
        ax.set_title(f"{title}\n(target {'≥' if higher else '≤'} {target})", fontsize=9)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("P5 placement: 4 workers, 64 agents x 10 tool turns; workload / GPU model")
    save_figure(fig, path)


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    parser.add_argument(
        "--workloads", type=lambda s: s.split(","), default=list(WORKLOADS),
        help="comma-separated: v1 (the first P5 workload), agentic (OpenHands-like)",
    )  # fmt: skip
    parser.add_argument(
        "--models", type=lambda s: s.split(","), default=list(MODELS),
        help="comma-separated emulator GPU models: independent, contention",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--turns", type=int, default=10)
    # Simulated GPU time must dominate the CPU work of 4 emulators, the server
    # and 64 agents on 2 cores, or wall-clock time measures this machine's CPU.
    parser.add_argument("--base-latency-s", type=float, default=0.1)
    parser.add_argument(
        "--prefill-s-per-token", type=float, default=0.001,
        help="independent model: a loaded GPU's share per request",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-prefill-s-per-token", type=float, default=0.0001,
        help="contention model: the whole GPU's prefill time per token",
    )  # fmt: skip
    parser.add_argument("--decode-s-per-token", type=float, default=0.025)
    parser.add_argument("--cache-capacity-tokens", type=int, default=1 << 20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    arguments = parser.parse_args()
    unknown = {*arguments.workloads} - {*WORKLOADS} | {*arguments.models} - {*MODELS}
    if unknown:
        parser.error(f"unknown workload or model: {', '.join(sorted(unknown))}")
    trio.run(main, arguments)
