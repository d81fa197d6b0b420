"""Engines: ``sglang-chat`` vs ``sglang-generate`` (with and without
``--kv-sessions delta``) vs ``vllm``.

``--agents`` (64) concurrent agents each run one tool episode of ``--turns``
(32) turns against a fresh session server and ``--workers`` (2) fresh emulator
processes, once per configuration and repeat:

- ``chat``: ``--engine sglang-chat`` (the worker's chat route parses);
- ``generate``: ``--engine sglang-generate --tool-call-parser qwen25`` (the
  server calls the worker's ``/parse_function_call`` after every answer; the
  emulator answers without reasoning, so no ``--reasoning-parser``);
- ``delta``: the same with ``--kv-sessions delta`` (each later turn sends
  only the ids the worker does not hold, over SGLang sessions);
- ``vllm``: ``--engine vllm --tool-call-parser hermes`` against vLLM
  emulators (``--engine vllm --enable-scale-out --tool-call-parser hermes``):
  one ``/inference/v1/generate`` per turn, parsed by the worker;
- ``auto``: no ``--engine`` and no parser flag, the default: the server
  reads the workers (SGLang emulators launched with ``--tool-call-parser
  qwen25``, as every SGLang configuration's are) and serves them with
  ``sglang-generate``.

Server and workers render with the bundled ``qwen3`` template
(``--chat-template qwen3`` on both), which writes the tools into the prompt,
so the emulator's model reads them: it calls a tool after a user message and
answers in text after a tool result. The episode alternates: user message,
tool call, tool result (40..400 words), text answer, next user message, ...
Turns run in lockstep: every agent's turn k, then every agent's turn k+1
(an RL rollout's batch), so each turn's traffic is counted on its own.

Each worker sits behind a counting TCP proxy (this script, ``--count-proxy``,
its own process) that passes bytes through unchanged and counts request
bodies per path: the main route (``/v1/chat/completions`` or
``/generate``), the parse routes, the session routes. The emulator's own
``bytes_received`` (main route only) is checked against the proxy's count.
Server CPU is the session server process and its children (validation
processes) from ``/proc`` over the measured window: session create, all
turns, DELETE. Configurations rotate order across ``--repeats`` (3); the
median and range are reported, and the CPU ratio to ``chat`` is paired
within each repeat. The emulator simulates no latency: every number is CPU
and loopback on the shared cores.

Targets: ``generate``, ``vllm`` and ``auto`` server CPU per turn ≤ 1.1× ``chat``;
``delta`` ≥ 10× fewer bytes sent to the workers at turn 32 than
``generate`` (parse routes included).

    python benches/engines.py
    python benches/engines.py --agents 16 --turns 8 --repeats 1
    python benches/engines.py --profile prof/   # py-spy the server, each run
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from _common import (
    Child,
    Window,
    after_tool_call,
    agent_client,
    bench_command,
    bench_parser,
    child,
    children,
    emulator_command,
    load_average,
    ms,
    profile,
    server_command,
    table,
    write_json,
)
from kv_sessions import RUN_COMMAND, words

TEMPLATE = ["--chat-template", "qwen3"]
GENERATE = ["--engine", "sglang-generate", "--tool-call-parser", "qwen25"]
CONFIGS: dict[str, list[str]] = {
    "chat": ["--engine", "sglang-chat"],
    "generate": GENERATE,
    "delta": [*GENERATE, "--kv-sessions", "delta"],
    "vllm": ["--engine", "vllm", "--tool-call-parser", "hermes"],
    # The default: no engine or parser named; the workers' are read.
    "auto": [],
}
# The workers each configuration runs against (SGLang emulators unless named).
WORKER_FLAGS: dict[str, list[str]] = {
    "vllm": [
        *("--engine", "vllm", "--enable-scale-out"),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    ],
}
MAIN_ROUTES = ("/v1/chat/completions", "/generate", "/inference/v1/generate")
PARSE_ROUTES = ("/parse_function_call", "/separate_reasoning", "/v1/chat/completions/render")
SESSION_ROUTES = ("/open_session", "/close_session")
_COUNTS_PATH = "/_bench/counts"
_RESULT_WORDS = (40, 80, 150, 250, 400)
_CLOSED = (trio.BrokenResourceError, trio.ClosedResourceError)


# -- the counting proxy (its own process) ------------------------------------------


@dataclass
class _Tally:
    requests: Counter[str] = field(default_factory=Counter)
    body: Counter[str] = field(default_factory=Counter)
    head: Counter[str] = field(default_factory=Counter)

    def as_json(self) -> bytes:
        return orjson.dumps({"requests": self.requests, "body": self.body, "head": self.head})


async def _pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    """Copy `source` to `sink` until either side closes."""
    with contextlib.suppress(*_CLOSED):
        while data := await source.receive_some(1 << 16):
            await sink.send_all(data)
    await sink.aclose()


async def _connection(client: trio.SocketStream, host: str, port: int, tally: _Tally) -> None:
    """One client connection: HTTP/1.1 requests with Content-Length bodies
    (what the server's client sends), counted per path and forwarded over
    one upstream connection; answers copied back unparsed."""
    upstream: list[trio.SocketStream] = []
    try:
        async with trio.open_nursery() as nursery:
            with contextlib.suppress(*_CLOSED):  # either side closed
                await _requests(client, host, port, tally, upstream, nursery)
            nursery.cancel_scope.cancel()
    finally:
        for stream in upstream:
            await stream.aclose()
        await client.aclose()


async def _requests(
    client: trio.SocketStream,
    host: str,
    port: int,
    tally: _Tally,
    upstream: list[trio.SocketStream],
    nursery: trio.Nursery,
) -> None:
    buffer = b""
    while True:
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            data = await client.receive_some(1 << 16)
            if not data:
                return
            buffer += data
        head, buffer = buffer[: end + 4], buffer[end + 4 :]
        lines = head.split(b"\r\n")
        path = lines[0].split(b" ")[1].split(b"?")[0].decode()
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                raise RuntimeError("the counting proxy takes Content-Length bodies only")
        if path == _COUNTS_PATH:
            body = tally.as_json()
            await client.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            continue
        if not upstream:
            upstream.append(await trio.open_tcp_stream(host, port))
            nursery.start_soon(_pump, upstream[0], client)
        await upstream[0].send_all(head)
        left = length
        while left:
            if not buffer:
                buffer = await client.receive_some(1 << 16)
                if not buffer:
                    return
            part, buffer = buffer[:left], buffer[left:]
            await upstream[0].send_all(part)
            left -= len(part)
        tally.requests[path] += 1
        tally.body[path] += length
        tally.head[path] += len(head)


async def count_proxy(upstream: str) -> None:
    url = httpx.URL(upstream)
    host, port = url.host, url.port or 80
    tally = _Tally()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    bound = listeners[0].socket.getsockname()[1]
    print(f"counting proxy listening on http://127.0.0.1:{bound}", flush=True)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def handle(stream: trio.SocketStream) -> None:
                await _connection(stream, host, port, tally)

            nursery.start_soon(trio.serve_listeners, handle, listeners)
            async for _ in signals:
                nursery.cancel_scope.cancel()


# -- the agents -------------------------------------------------------------------


@dataclass
class Agent:
    index: int
    client: httpx.AsyncClient
    url: str = ""
    session_id: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.index)

    async def start(self, server: str, system_words: int) -> None:
        created = await self.client.post(f"{server}/sessions")
        created.raise_for_status()
        self.session_id = created.json()["session_id"]
        self.url = f"{server}/sessions/{self.session_id}/v1/chat/completions"
        self.messages = [
            {"role": "system", "content": words(system_words, 0)},
            {"role": "user", "content": f"Task {self.index}: " + words(60, self.index)},
        ]

    async def turn(self, turn: int) -> bool:
        """One turn; True when the model called a tool."""
        body = {"messages": self.messages, "tools": [RUN_COMMAND], "max_tokens": 256}
        body["seed"] = self.index * 100 + turn
        response = await self.client.post(self.url, content=orjson.dumps(body))
        if response.status_code != 200:
            raise RuntimeError(
                f"agent {self.index} turn {turn + 1}: {response.status_code} "
                f"{response.content[:300]!r}"
            )
        message = orjson.loads(response.content)["choices"][0]["message"]
        if message.get("tool_calls"):
            result = words(self.rng.choice(_RESULT_WORDS), self.index * 31 + turn)
            self.messages = after_tool_call(self.messages, response.content, result)
            return True
        self.messages = [
            *self.messages,
            {"role": "assistant", "content": message.get("content") or ""},
            {"role": "user", "content": f"Step {turn}: " + words(30, self.index + turn)},
        ]
        return False

    async def finish(self, server: str) -> None:
        deleted = await self.client.delete(f"{server}/sessions/{self.session_id}")
        deleted.raise_for_status()


async def _each(agents: list[Agent], call: Any) -> list[Any]:
    results: list[Any] = [None] * len(agents)

    async def one(i: int) -> None:
        results[i] = await call(agents[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(agents)):
            nursery.start_soon(one, i)
    return results


async def _counts(client: httpx.AsyncClient, proxies: list[Child]) -> dict[str, Counter[str]]:
    total: dict[str, Counter[str]] = {"requests": Counter(), "body": Counter(), "head": Counter()}
    for proxy in proxies:
        data = (await client.get(f"{proxy.url}{_COUNTS_PATH}")).json()
        for key, counter in total.items():
            counter.update(data[key])
    return total


def _minus(after: dict[str, Counter[str]], before: dict[str, Counter[str]]) -> dict[str, Any]:
    return {key: after[key] - before[key] for key in after}


def _sum(counter: Counter[str], paths: tuple[str, ...]) -> int:
    return sum(counter[p] for p in paths)


async def warm_up(server: str, args: argparse.Namespace) -> None:
    """4 short episodes (not measured): lazy imports, template compilation, pools."""
    async with agent_client(timeout=600) as client:
        agents = [Agent(10_000 + i, client) for i in range(4)]
        await _each(agents, lambda a: a.start(server, args.system_words))
        for turn in range(4):
            await _each(agents, lambda a, t=turn: a.turn(t))
        await _each(agents, lambda a: a.finish(server))


async def run_config(name: str, rep: int, args: argparse.Namespace) -> dict[str, Any]:
    emulator_flags = [*TEMPLATE, "--record-limit", "0", "--seed", "0", *WORKER_FLAGS.get(name, [])]
    specs = [(f"worker{i}", emulator_command(*emulator_flags)) for i in range(args.workers)]
    async with children(specs) as workers:
        proxy_specs = [
            (f"proxy{i}", bench_command("engines.py", "--count-proxy", w.url))
            for i, w in enumerate(workers)
        ]
        async with children(proxy_specs) as proxies:
            command = server_command([p.url for p in proxies], *TEMPLATE, *CONFIGS[name])
            async with child("server", command, marker="rollout-session listening on") as server:
                return await measure(name, rep, server, workers, proxies, args)


async def measure(
    name: str,
    rep: int,
    server: Child,
    workers: list[Child],
    proxies: list[Child],
    args: argparse.Namespace,
) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as control:
        await warm_up(server.url, args)
        stats_before = [(await control.get(f"{w.url}/emulator/stats")).json() for w in workers]
        clients = [agent_client(timeout=600) for _ in range(args.agents)]
        agents = [Agent(i, c) for i, c in enumerate(clients)]
        per_turn: list[dict[str, Any]] = []
        calls = 0
        prof = args.profile / f"engines-{name}-r{rep}.txt" if args.profile else None
        try:
            start = await _counts(control, proxies)
            window = Window([server, *workers, *proxies])
            began = time.perf_counter()
            async with profile(server if prof else None, prof, rate=200):
                await _each(agents, lambda a: a.start(server.url, args.system_words))
                before = start
                for turn in range(args.turns):
                    calls += sum(await _each(agents, lambda a, t=turn: a.turn(t)))
                    after = await _counts(control, proxies)
                    per_turn.append(_minus(after, before))
                    before = after
                await _each(agents, lambda a: a.finish(server.url))
            wall = time.perf_counter() - began
            usage = window.finish()
            await trio.sleep(0.5)  # background /close_session calls land
            whole = _minus(await _counts(control, proxies), start)
        finally:
            for c in clients:
                await c.aclose()
        stats = [(await control.get(f"{w.url}/emulator/stats")).json() for w in workers]
    turns = args.agents * args.turns
    received = sum(s["bytes_received"] for s in stats) - sum(
        s["bytes_received"] for s in stats_before
    )
    last = per_turn[-1]
    body = whole["body"]
    return {
        "config": name,
        "repeat": rep,
        "turns": turns,
        "tool calls": calls,
        "server CPU ms/turn": ms(usage["server_cpu_s"] / turns),
        "server loop CPU ms/turn": ms(usage["server_main_cpu_s"] / turns),
        "workers CPU ms/turn": ms(sum(usage[f"{w.name}_cpu_s"] for w in workers) / turns),
        "proxies CPU ms/turn": ms(sum(usage[f"{p.name}_cpu_s"] for p in proxies) / turns),
        "requests/turn": sum(whole["requests"].values()) / turns,
        "last route KB/turn": _sum(last["body"], MAIN_ROUTES) / args.agents / 1024,
        "last parse KB/turn": _sum(last["body"], PARSE_ROUTES) / args.agents / 1024,
        "last KB/turn": sum(last["body"].values()) / args.agents / 1024,
        "route KB/turn": _sum(body, MAIN_ROUTES) / turns / 1024,
        "parse KB/turn": _sum(body, PARSE_ROUTES) / turns / 1024,
        "session KB/turn": _sum(body, SESSION_ROUTES) / turns / 1024,
        "KB/turn": sum(body.values()) / turns / 1024,
        "head KB/turn": sum(whole["head"].values()) / turns / 1024,
        "bytes check": _sum(body, MAIN_ROUTES) / max(received, 1),
        "wall s": wall,
        "foreign cores": usage["foreign_cores"],
        "paths": dict(whole["requests"]),
        "KB by turn": [sum(t["body"].values()) / args.agents / 1024 for t in per_turn],
    }


# -- the report --------------------------------------------------------------------


def spread(values: list[float]) -> str:
    """Median and range."""
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.median(values):.3g} ({min(values):.3g}–{max(values):.3g})"


_SUMMARY = [
    "server CPU ms/turn",
    "x chat CPU",
    "server loop CPU ms/turn",
    "workers CPU ms/turn",
    "requests/turn",
    "last route KB/turn",
    "last parse KB/turn",
    "last KB/turn",
    "route KB/turn",
    "parse KB/turn",
    "session KB/turn",
    "KB/turn",
    "wall s",
    "foreign cores",
]
_RUN_COLUMNS = [
    "config",
    "repeat",
    "tool calls",
    "server CPU ms/turn",
    "server loop CPU ms/turn",
    "workers CPU ms/turn",
    "proxies CPU ms/turn",
    "last KB/turn",
    "KB/turn",
    "head KB/turn",
    "bytes check",
    "wall s",
    "foreign cores",
]


def summarise(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    chat = {r["repeat"]: r["server CPU ms/turn"] for r in runs if r["config"] == "chat"}
    for r in runs:
        if r["repeat"] in chat:
            r["x chat CPU"] = r["server CPU ms/turn"] / chat[r["repeat"]]
    rows = []
    for name in names:
        mine = [r for r in runs if r["config"] == name]
        row: dict[str, Any] = {"config": name}
        for key in _SUMMARY:
            values = [r[key] for r in mine if key in r]
            row[key] = spread(values) if values else "-"
        rows.append(row)
    return rows


def targets(runs: list[dict[str, Any]]) -> list[str]:
    out = []
    for name in ("generate", "vllm", "auto"):
        ratios = [r["x chat CPU"] for r in runs if r["config"] == name and "x chat CPU" in r]
        if ratios:
            mid = statistics.median(ratios)
            verdict = "met" if mid <= 1.1 else f"MISSED by {100 * (mid / 1.1 - 1):.0f} %"
            out.append(
                f"{name} server CPU/turn vs chat: {spread(ratios)}x (target <= 1.1x): {verdict}"
            )
    by_rep: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_rep.setdefault(r["repeat"], {})[r["config"]] = r
    fewer = [
        (p["generate"]["last KB/turn"] / p["delta"]["last KB/turn"])
        for p in by_rep.values()
        if {"generate", "delta"} <= p.keys()
    ]
    route_only = [
        (p["generate"]["last route KB/turn"] / p["delta"]["last route KB/turn"])
        for p in by_rep.values()
        if {"generate", "delta"} <= p.keys()
    ]
    if fewer:
        mid = statistics.median(fewer)
        verdict = "met" if mid >= 10 else f"MISSED: {mid:.1f}x of 10x"
        out.append(
            f"delta vs generate, bytes at the last turn incl. parse routes: {spread(fewer)}x "
            f"fewer (target >= 10x): {verdict}; /generate alone: {spread(route_only)}x"
        )
    return out


async def main(args: argparse.Namespace) -> None:
    names = args.configs
    print(
        f"{load_average()}; {args.workers} emulator workers (qwen3 template, no latency), "
        f"{args.agents} agents x {args.turns} lockstep turns, configs {', '.join(names)}, "
        f"{args.repeats} repeats (rotating order)"
    )
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            runs.append(await run_config(name, rep, args))
            print(table([runs[-1]], _RUN_COLUMNS), flush=True)
    rows = summarise(runs, names)
    print()
    print(load_average())
    print(table(runs, _RUN_COLUMNS))
    print()
    print(f"median (min–max) over repeats; 'last': turn {args.turns}, the last turn")
    print(table(rows, ["config", *_SUMMARY]))
    print()
    for line in targets(runs):
        print(line)
    write_json(
        args.json,
        {
            "args": {k: str(v) for k, v in vars(args).items()},
            "load": load_average(),
            "runs": runs,
            "summary": rows,
        },
    )


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--configs",
        type=lambda s: s.split(","),
        default=list(CONFIGS),
        help="chat,generate,delta,vllm",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--profile", type=Path, help="py-spy the server into this dir")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--count-proxy", metavar="UPSTREAM", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.count_proxy:
        trio.run(count_proxy, arguments.count_proxy)
    else:
        if {*arguments.configs} - {*CONFIGS}:
            parser.error(f"--configs: {', '.join(CONFIGS)}")
        trio.run(main, arguments)
