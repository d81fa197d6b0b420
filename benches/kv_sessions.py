"""Worker-side KV sessions under cache pressure: ``--kv-sessions off`` vs ``hint``.

A continuous rollout against ``--workers`` (2) emulator processes started with
SGLang's ``--enable-session-radix-cache`` and a prefix cache too small for
every live agent's history (``--cache-capacity-tokens``, per worker). For
each mode a fresh session server (``--kv-sessions MODE``) and fresh workers
run the same rollout: ``--slots`` (64) concurrent agent slots work through
``--episodes`` (128) episodes; each episode has 8..32 tool turns (episode 0
has 32) with a tool latency between turns (exponential, mean ``--tool-s``,
at most 4x it: the agent is idle, its KV waits on the worker), then is
collected with DELETE and its slot starts the next episode. Episode
parameters come from the episode's index, so both modes run the same
episodes (the order of turns across slots differs run to run).

Under ``hint`` every turn carries ``session_id`` (the worker references the
session's latest turn in its radix cache, so eviction takes unreferenced KV
first) and a collected session's ``/close_session`` dereferences its KV
(first in line for eviction, nothing freed). Under ``off`` the cache is plain
LRU.

Reported per mode:

- prefill tokens: the workers' ``prefill_tokens`` counters (prompt tokens
  computed, not served from KV);
- history recomputed: prompt tokens an episode had already sent in earlier
  turns that were not served from cache (turns 2+; what eviction cost);
- hit %: cached / prompt tokens over all turns; turns 2+ separately;
- bytes/turn: the workers' ``bytes_received`` per request (measured), and
  at turn 32 the request the server forwards (reconstructed exactly: the
  agent's body + the forced fields + ``input_ids`` from the trajectory +
  ``session_id`` under hint; the reconstruction's total is checked against
  the measured one);
- total s: wall clock of the whole rollout; model GPU s: the emulator's
  latency model summed over all turns (free of this machine's CPU limits).

    python benches/kv_sessions.py
    python benches/kv_sessions.py --episodes 32 --slots 16 --cache-capacity-tokens 20000
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from _common import (
    FORCED,
    WORDS,
    Window,
    after_tool_call,
    bench_parser,
    child,
    children,
    emulator_command,
    load_average,
    server_command,
    table,
    write_json,
)

MODES = ("off", "hint")

RUN_COMMAND = {
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


def words(n: int, salt: int) -> str:
    return " ".join(WORDS[(i * 7 + salt * 3 + i // 10) % len(WORDS)] for i in range(n))


@dataclass(frozen=True)
class Episode:
    index: int
    turns: int
    result_words: tuple[int, ...]  # tool result size after each turn
    tool_s: tuple[float, ...]  # tool latency after each turn

    @classmethod
    def make(cls, index: int, mean_tool_s: float) -> Episode:
        rng = random.Random(index)
        turns = 32 if index == 0 else rng.randint(8, 32)
        results = tuple(rng.choice((40, 80, 150, 250, 400)) for _ in range(turns))
        tool = tuple(min(4 * mean_tool_s, rng.expovariate(1 / mean_tool_s)) for _ in range(turns))
        return cls(index, turns, results, tool)


@dataclass
class Collected:
    episode: Episode
    document: dict[str, Any]
    body_bytes: list[int]  # the agent's request body per turn


async def run_episode(
    client: httpx.AsyncClient, server: str, ep: Episode, args: argparse.Namespace
) -> Collected:
    created = await client.post(f"{server}/sessions", json={"metadata": {"episode": ep.index}})
    created.raise_for_status()
    session_id = created.json()["session_id"]
    url = f"{server}/sessions/{session_id}/v1/chat/completions"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words(args.system_words, 0)},
        {"role": "user", "content": f"Task {ep.index}: " + words(60, ep.index)},
    ]
    sizes = []
    for turn in range(ep.turns):
        body = {
            "messages": messages,
            "tools": [RUN_COMMAND],
            "tool_choice": "required",
            "max_tokens": 256,
            "seed": ep.index * 100 + turn,
        }
        content = orjson.dumps(body)
        sizes.append(len(content))
        response = await client.post(url, content=content)
        if response.status_code != 200:
            raise RuntimeError(f"episode {ep.index} turn {turn}: {response.status_code}")
        result = words(ep.result_words[turn], ep.index * 31 + turn)
        messages = after_tool_call(messages, response.content, result)
        if turn + 1 < ep.turns:
            await trio.sleep(ep.tool_s[turn])  # the tool runs; the agent is idle
    # v1's document (the last segment at the top level: one segment here).
    deleted = await client.delete(f"{server}/sessions/{session_id}", params={"schema": 1})
    deleted.raise_for_status()
    return Collected(ep, orjson.loads(deleted.content), sizes)


def forwarded_bytes(c: Collected, turn: int, hint: bool) -> int:
    """Exact size of the worker request for one turn: what the session server
    forwards (the agent's body, the forced fields, input_ids, the hint)."""
    t = c.document["turns"][turn]
    extra: dict[str, Any] = {
        **FORCED,
        "input_ids": c.document["token_ids"][: t["completion_start"]],
    }
    if hint:
        extra["session_id"] = c.document["session_id"]
    # The agent's body ends with "}"; the server's fields follow it, comma-separated.
    return c.body_bytes[turn] + len(orjson.dumps(extra)) - 1


async def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = [
        "--base-latency-s", str(args.base_latency_s),
        "--prefill-s-per-token", str(args.prefill_s_per_token),
        "--decode-s-per-token", str(args.decode_s_per_token),
        "--cache-capacity-tokens", str(args.cache_capacity_tokens),
        "--enable-session-radix-cache",
        "--record-limit", "0",
        "--seed", "0",
    ]  # fmt: skip
    specs = [(f"worker{i}", emulator_command(*flags)) for i in range(args.workers)]
    episodes = [Episode.make(i, args.tool_s) for i in range(args.episodes)]
    collected: list[Collected] = []
    async with children(specs) as workers:
        urls = [w.url for w in workers]
        async with child(
            "server",
            server_command(urls, "--kv-sessions", mode),
            marker="rollout-session listening on",
        ) as server:
            limits = httpx.Limits(max_connections=args.slots + 8)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                queue = iter(episodes)

                async def slot() -> None:
                    for ep in queue:  # a shared iterator: each episode runs once
                        collected.append(await run_episode(client, server.url, ep, args))

                started = time.perf_counter()
                window = Window([*workers, server])
                async with trio.open_nursery() as nursery:
                    for _ in range(args.slots):
                        nursery.start_soon(slot)
                total_s = time.perf_counter() - started
                usage = window.finish()
                stats = [(await client.get(f"{u}/emulator/stats")).json() for u in urls]

    prompt = cached = prompt_later = cached_later = history = recomputed = 0
    gpu_s = 0.0
    reconstructed = 0
    at_32: list[int] = []
    for c in collected:
        for t in c.document["turns"]:
            sent = t["completion_start"]
            hit = t["cached_tokens"] or 0
            prompt += sent
            cached += hit
            gpu_s += (
                args.base_latency_s
                + args.prefill_s_per_token * (sent - hit)
                + args.decode_s_per_token * (t["completion_end"] - t["completion_start"])
            )
            reconstructed += forwarded_bytes(c, t["index"], mode == "hint")
            if t["index"]:
                prompt_later += sent
                cached_later += hit
                history += t["prompt_start"]
                recomputed += max(0, t["prompt_start"] - hit)
            if t["index"] == 31:
                at_32.append(forwarded_bytes(c, 31, mode == "hint"))
    requests = sum(s["completed"] for s in stats)
    received = sum(s["bytes_received"] for s in stats)
    return {
        "mode": mode,
        "episodes": len(collected),
        "turns": sum(len(c.document["turns"]) for c in collected),
        "prefill tokens": sum(s["prefill_tokens"] for s in stats),
        "history recomputed": recomputed,
        "history recomputed %": 100 * recomputed / max(history, 1),
        "hit %": 100 * cached / max(prompt, 1),
        "hit % turns 2+": 100 * cached_later / max(prompt_later, 1),
        "KB/turn": received / max(requests, 1) / 1024,
        "KB at turn 32": (sum(at_32) / len(at_32) / 1024) if at_32 else math.nan,
        "bytes check": reconstructed / max(received, 1),
        "total s": total_s,
        "model GPU s": gpu_s,
        "ours cores": usage["machine_cores"] - usage["foreign_cores"],
        "foreign cores": usage["foreign_cores"],
    }


_COLUMNS = [
    "mode",
    "episodes",
    "turns",
    "prefill tokens",
    "history recomputed",
    "history recomputed %",
    "hit %",
    "hit % turns 2+",
    "KB/turn",
    "KB at turn 32",
    "bytes check",
    "total s",
    "model GPU s",
    "ours cores",
    "foreign cores",
]


async def main(args: argparse.Namespace) -> None:
    print(
        f"{load_average()}; {args.workers} workers (cache {args.cache_capacity_tokens} tokens "
        f"each, --enable-session-radix-cache), {args.slots} slots x {args.episodes} episodes "
        f"of 8..32 turns, tool latency mean {args.tool_s} s; base {args.base_latency_s} s, "
        f"prefill {args.prefill_s_per_token} s/token, decode {args.decode_s_per_token} s/token"
    )
    rows = []
    for mode in args.modes:
        rows.append(await run_mode(mode, args))
        print(table([rows[-1]], _COLUMNS), flush=True)
    print()
    print(load_average())
    print(table(rows, _COLUMNS))
    write_json(
        args.json,
        {"args": {k: str(v) for k, v in vars(args).items()}, "load": load_average(), "rows": rows},
    )


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--tool-s", type=float, default=1.0, help="mean tool latency")
    parser.add_argument("--cache-capacity-tokens", type=int, default=40_000)
    parser.add_argument("--base-latency-s", type=float, default=0.1)
    parser.add_argument("--prefill-s-per-token", type=float, default=0.001)
    parser.add_argument("--decode-s-per-token", type=float, default=0.025)
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args()
    if {*arguments.modes} - {*MODES}:
        parser.error(f"--modes: {', '.join(MODES)}")
    trio.run(main, arguments)
