"""Server CPU per turn by agent protocol: the same conversations through chat
completions, the Responses API and the Anthropic Messages API (issue 19's
bench), streamed and not.

An emulator process and a session server process on loopback; each path
runs the same multi-turn conversations (first prompt ~``--prompt-tokens``,
answers of ``--completion-tokens``, a short user message each later turn),
the paths taking turns ``--repeats`` times. What is reported per path is the
session server's CPU time per turn (its process, all threads, read from
/proc), and the agent-observed p50 latency; the target is each other
protocol at most 1.2× the chat route's CPU per turn.

    .venv/bin/python benches/protocols.py
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from _common import (
    Child,
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

PATHS = (
    "chat",
    "chat-stream",
    "responses",
    "responses-stream",
    "messages",
    "messages-stream",
)
_ROUTES = {"chat": "chat/completions", "responses": "responses", "messages": "messages"}
TARGET = 1.2


def first_prompt(tokens: int, salt: int) -> str:
    # ~1 token per word of the bundled vocabulary's common words.
    words = ["alpha", "beta", "gamma", "delta", "omega", "river", "stone", "cloud"]
    return " ".join(words[(i + salt) % len(words)] for i in range(tokens))


def _text_of_chat(body: bytes, stream: bool) -> str:
    if not stream:
        answer = orjson.loads(body)
        return str(answer["choices"][0]["message"]["content"] or "")
    text = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


def _text_of_response(body: bytes, stream: bool) -> str:
    if stream:
        done = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
        response = orjson.loads(done[-1][6:])["response"]
    else:
        response = orjson.loads(body)
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def _text_of_message(body: bytes, stream: bool) -> str:
    if not stream:
        return "".join(b["text"] for b in orjson.loads(body)["content"] if b["type"] == "text")
    text = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            delta = orjson.loads(line[6:]).get("delta") or {}
            if delta.get("type") == "text_delta":
                text.append(delta["text"])
    return "".join(text)


_TEXT = {"chat": _text_of_chat, "responses": _text_of_response, "messages": _text_of_message}


async def conversation(
    client: httpx.AsyncClient, front: str, path: str, index: int, args: argparse.Namespace
) -> list[float]:
    created = await client.post(f"{front}/sessions")
    created.raise_for_status()
    session = created.json()["session_id"]
    stream = path.endswith("-stream")
    protocol = path.removesuffix("-stream")
    url = f"{front}/sessions/{session}/v1/{_ROUTES[protocol]}"
    history: list[dict[str, Any]] = [
        {"role": "user", "content": first_prompt(args.prompt_tokens, index)}
    ]
    latencies = []
    for turn in range(args.turns):
        if protocol == "responses":
            body: dict[str, Any] = {"input": history, "max_output_tokens": args.completion_tokens}
        else:  # chat and Messages take these alike for text-only turns
            body = {"messages": history, "max_tokens": args.completion_tokens}
        if protocol == "messages":
            body["model"] = "any"
        body |= {"seed": index, "stream": stream}
        started = trio.current_time()
        response = await client.post(url, content=orjson.dumps(body))
        latencies.append(trio.current_time() - started)
        response.raise_for_status()
        text = _TEXT[protocol](response.content, stream)
        history = [
            *history,
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Continue with step {turn}."},
        ]
    (await client.delete(f"{front}/sessions/{session}")).raise_for_status()
    return latencies


async def run_path(server: Child, path: str, args: argparse.Namespace) -> tuple[float, list[float]]:
    """(server CPU seconds, latencies) of one run of every conversation."""
    latencies: list[float] = []
    before = server.cpu_s()

    async def agent(first: int) -> None:
        async with agent_client(timeout=300) as client:
            for index in range(first, args.sessions, args.concurrency):
                latencies.extend(await conversation(client, server.url, path, index, args))

    async with trio.open_nursery() as nursery:
        for first in range(args.concurrency):
            nursery.start_soon(agent, first)
    return server.cpu_s() - before, latencies


async def main(args: argparse.Namespace) -> None:
    print(load_average())
    flags = ["--completion-tokens", str(args.completion_tokens), "--record-limit", "0"]
    async with (
        child("emulator", emulator_command(*flags)) as emulator,
        child(
            "server", server_command([emulator.url]), marker="rollout-session listening on"
        ) as server,
    ):
        warm = argparse.Namespace(**{**vars(args), "sessions": 2})
        for path in PATHS:
            await run_path(server, path, warm)
        cpu = {path: [] for path in PATHS}
        latency: dict[str, list[float]] = {path: [] for path in PATHS}
        for rep in range(args.repeats):
            # Each repeat runs the paths in another order: none always last.
            order = PATHS[rep % len(PATHS) :] + PATHS[: rep % len(PATHS)]
            for path in order:
                seconds, latencies = await run_path(server, path, args)
                cpu[path].append(seconds / len(latencies))
                latency[path] += latencies
    chat = {False: statistics.median(cpu["chat"]), True: statistics.median(cpu["chat-stream"])}
    rows = []
    for path in PATHS:
        per_turn = statistics.median(cpu[path])
        rows.append(
            {
                "path": path,
                "turns": len(latency[path]),
                "server CPU ms/turn": ms(per_turn),
                "× chat (same streaming)": round(per_turn / chat[path.endswith("-stream")], 3),
                "p50 ms": ms(pct(latency[path], 50)),
            }
        )
    print(load_average())
    print(table(rows))
    worst = max(r["× chat (same streaming)"] for r in rows if not r["path"].startswith("chat"))
    verdict = "met" if worst <= TARGET else "NOT met"
    print(f"target: each protocol ≤ {TARGET}× chat: worst {worst:.3f}× → {verdict}")
    write_json(args.json, {"load": load_average(), "rows": rows})


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--sessions", type=int, default=24, help="conversations per run")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    trio.run(main, parser.parse_args())
