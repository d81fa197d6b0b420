"""Oversize chat bodies: what refusing them costs, and what they do to others.

One agent posts a first turn of ``--sizes`` MiB (default 1, 10, 30) in each
of the ``--shapes`` to a server whose model context is ``--context-length``
(32768) tokens and whose ``--max-body-mb`` is 64:

- ``words``: one user message of words, refused with 400
  ``context_length_exceeded``;
- ``tiny``: as many tiny messages as fill the size (``{"role": "user",
  "content": "a"}``, ~31 bytes each: 500k in 15 MiB), refused for their
  number (400 ``invalid_request``, ``--max-messages``), counted before the
  body is parsed (before that limit: parsed, normalised and tokenised,
  then 400 ``context_length_exceeded``).

While each request runs, a separate process polls ``/health`` every 10 ms
and another agent takes small turns. Each size is posted ``--repeat`` (5)
times back to back. Reported per size: the time to each refusal and the
server's CPU seconds for it (its main process, all threads; means over the
repeats), its RSS growth (peak, and what stays), ``/health`` p50 / p99 /
max and the other agent's turn p50 / p99 over the window; the baseline rows
("idle") are the same probes for 2 s with no oversize body, on the same
server in the same run.

With ``--segments N`` (0: off) it also posts, to one session (every server
runs with ``--journal``), N requests that each start a new segment (their
first user message differs) and carry ``--segment-mb`` (12) MiB of
reasoning in a past answer, text the chat template never renders: reported
are their statuses, the server's CPU seconds, its RSS growth and the
journal's growth (``--max-session-mb`` refuses them from its budget on: 400
``session_too_large``; before it, each was stored and journaled).

With ``--compare-with DIR`` the same bodies also go to a server running the
package exported at DIR (``git archive <commit> rollout_session | tar -x -C
DIR``), one after the other: before/after in one run.

    python benches/big_bodies.py
    python benches/big_bodies.py --sizes 10,30 --compare-with /tmp/rs-before
    python benches/big_bodies.py --shapes tiny --sizes 15 --segments 20 --compare-with main
"""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from _common import (
    Child,
    bench_parser,
    child,
    emulator_command,
    health_probe,
    load_average,
    ms,
    package_at,
    pct,
    server_command,
    table,
    write_json,
)

_WORDS = "lorem ipsum dolor sit amet "


async def _neighbour(client: httpx.AsyncClient, latencies: list[float]) -> None:
    """Another agent's small turns, back to back (each repeats the first:
    a retry, so the history stays one turn long)."""
    session_id = (await client.post("/sessions", json={})).json()["session_id"]
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16}
    while True:
        started = time.perf_counter()
        response = await client.post(f"/sessions/{session_id}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        latencies.append(time.perf_counter() - started)


async def _probe_while(server: Child, work: Any) -> tuple[Any, dict[str, Any]]:
    """Run `work` while `/health` is polled and a neighbour takes turns; the
    server's CPU and memory around it."""
    turns: list[float] = []
    async with (
        health_probe(server.url) as probe,
        httpx.AsyncClient(base_url=server.url, timeout=600) as neighbour,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_neighbour, neighbour, turns)
        await trio.sleep(0.5)  # both probes answer: they are running
        server.reset_peak_memory()  # the peak's growth is then this work's
        rss_before, _ = server.memory_mib()
        cpu_before = server.main_cpu_s()
        turns.clear()
        result = await work()
        cpu = server.main_cpu_s() - cpu_before
        busy = list(turns)
        await trio.sleep(0.2)
        rss_after, peak_after = server.memory_mib()
        nursery.cancel_scope.cancel()
    health = probe.latencies
    return result, {
        "server CPU s": round(cpu, 3),
        "RSS peak +MiB": round(peak_after - rss_before, 1),
        "RSS kept +MiB": round(rss_after - rss_before, 1),
        "/health p50 ms": ms(pct(health, 50)),
        "/health p99 ms": ms(pct(health, 99)),
        "/health max ms": ms(max(health)),
        "other turns": len(busy),
        "other turn p50 ms": ms(pct(busy, 50)) if busy else None,
        "other turn p99 ms": ms(pct(busy, 99)) if busy else None,
    }


def make_body(shape: str, size: float) -> bytes:
    """A first turn of about `size` MiB in `shape` (see the module)."""
    total = int(size * 2**20)
    if shape == "words":
        text = _WORDS * (total // len(_WORDS))
        return orjson.dumps({"messages": [{"role": "user", "content": text}]})
    if shape == "tiny":
        tiny = {"role": "user", "content": "a"}
        count = total // (len(orjson.dumps(tiny)) + 1)
        return orjson.dumps({"messages": [tiny] * count})
    raise ValueError(f"unknown shape {shape!r}")


def segment_body(index: int, size: float) -> bytes:
    """A request starting a new segment (its first message is new) whose past
    answer carries `size` MiB of reasoning the chat template never renders."""
    answer = {"role": "assistant", "content": "ok", "reasoning_content": "x" * int(size * 2**20)}
    task = {"role": "user", "content": f"Task {index}."}
    return orjson.dumps({"messages": [task, answer, {"role": "user", "content": "Go on."}]})


def _tree_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


async def measure_segments(
    server: Child, label: str, journal: Path, count: int, size: float
) -> dict[str, Any]:
    """`count` segments of `size` MiB of unrendered reasoning to one session."""
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        session_id = (await client.post("/sessions", json={})).json()["session_id"]
        await trio.sleep(0.5)
        rss_before, _ = server.memory_mib()
        journal_before = _tree_mib(journal)
        cpu_before = server.main_cpu_s()
        for i in range(count):
            response = await client.post(
                f"/sessions/{session_id}/v1/chat/completions",
                content=segment_body(i, size),
                headers={"content-type": "application/json"},
            )
            code = response.json().get("error", {}).get("code", "") if response.is_error else ""
            key = f"{response.status_code} {code}".strip()
            statuses[key] = statuses.get(key, 0) + 1
        cpu = server.main_cpu_s() - cpu_before
        await trio.sleep(1.5)  # the journal's interval fsync
        rss_after, _ = server.memory_mib()
    return {
        "server": label,
        "requests": f"{count} × {size:g} MiB",
        "statuses": ", ".join(f"{n}× {k}" for k, n in statuses.items()),
        "server CPU s": round(cpu, 2),
        "RSS kept +MiB": round(rss_after - rss_before, 1),
        "journal +MiB": round(_tree_mib(journal) - journal_before, 1),
    }


async def measure(
    server: Child, label: str, sizes: list[float], repeat: int, shapes: list[str]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    async def idle() -> None:
        await trio.sleep(2)

    _, idle_stats = await _probe_while(server, idle)
    rows.append(
        {
            "server": label,
            "shape": "",
            "body MiB": 0,
            "status": "idle",
            "answer ms": 0.0,
            **idle_stats,
        }
    )
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        for shape, size in itertools.product(shapes, sizes):
            created = await client.post("/sessions", json={})
            session_id = created.json()["session_id"]
            body = make_body(shape, size)

            async def post(session_id: str = session_id, body: bytes = body) -> Any:
                started = time.perf_counter()
                for _ in range(repeat):
                    response = await client.post(
                        f"/sessions/{session_id}/v1/chat/completions",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                return response, (time.perf_counter() - started) / repeat

            (response, elapsed), stats = await _probe_while(server, post)
            stats["server CPU s"] = round(stats["server CPU s"] / repeat, 3)
            code = response.json().get("error", {}).get("code", response.status_code)
            rows.append(
                {
                    "server": label,
                    "shape": shape,
                    "body MiB": size,
                    "status": f"{response.status_code} {code}",
                    "answer ms": ms(elapsed),
                    **stats,
                }
            )
            print(table(rows[-1:]), flush=True)
    return rows


async def main(
    sizes: list[float],
    shapes: list[str],
    context_length: int,
    compare_with: Path | None,
    repeat: int,
    segments: int,
    segment_mb: float,
) -> Any:
    print(load_average())
    flags = ["--context-length", str(context_length), "--max-body-mb", "64"]
    rows: list[dict[str, Any]] = []
    segment_rows: list[dict[str, Any]] = []
    servers = [("now", None)]
    if compare_with is not None:
        servers.append((f"before ({compare_with})", compare_with))
    async with child("emulator", emulator_command("--record-limit", "0")) as emulator:
        for label, package in servers:
            with tempfile.TemporaryDirectory(prefix="big-bodies-journal-") as journal:
                command = server_command([emulator.url], *flags, "--journal", journal)
                if package is not None:
                    command = ["env", f"PYTHONPATH={package}", *command]
                name = "server" if package is None else "server-before"
                async with child(name, command, marker="rollout-session listening on") as server:
                    rows += await measure(server, label, sizes, repeat, shapes)
                    if segments:
                        segment_rows.append(
                            await measure_segments(
                                server, label, Path(journal), segments, segment_mb
                            )
                        )
                        print(table(segment_rows[-1:]), flush=True)
    print(table(rows))
    if segment_rows:
        print(table(segment_rows))
    print(load_average())
    return {"bodies": rows, "segments": segment_rows}


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", default="1,10,30", help="body sizes, MiB")
    parser.add_argument(
        "--shapes", default="words", help="body shapes: words, tiny (comma-separated)"
    )
    parser.add_argument(
        "--segments", type=int, default=0, help="segments of unrendered reasoning to one session"
    )
    parser.add_argument("--segment-mb", type=float, default=12.0, help="reasoning per segment")
    parser.add_argument("--context-length", type=int, default=32768)
    parser.add_argument(
        "--compare-with", type=package_at, help="baseline: a package dir or a git revision"
    )
    parser.add_argument("--repeat", type=int, default=5, help="refusals per size, back to back")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    before = args.compare_with.resolve() if args.compare_with else None
    shapes = args.shapes.split(",")
    result = trio.run(
        main,
        sizes,
        shapes,
        args.context_length,
        before,
        args.repeat,
        args.segments,
        args.segment_mb,
    )
    write_json(args.json, result)
