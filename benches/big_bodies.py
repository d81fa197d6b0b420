"""Oversize chat bodies: what refusing them costs, and what they do to others.

One agent posts a first turn whose user message is ``--sizes`` MiB of words
(default 1, 10, 30) to a server whose model context is ``--context-length``
(32768) tokens and whose ``--max-body-mb`` is 64, so every body is refused
with 400 ``context_length_exceeded``. While each request runs, a separate
process polls ``/health`` every 10 ms and another agent takes small turns.
Each size is posted ``--repeat`` (5) times back to back. Reported per size:
the time to each refusal and the server's CPU seconds for it (its main
process, all threads; means over the repeats), its RSS growth (peak, and
what stays), ``/health`` p50 / p99 / max and the other agent's turn p50 /
p99 over the window; the baseline rows ("idle") are the same probes for
2 s with no oversize body, on the same server in the same run.

With ``--compare-with DIR`` the same bodies also go to a server running the
package exported at DIR (``git archive <commit> rollout_session | tar -x -C
DIR``), one after the other: before/after in one run.

    python benches/big_bodies.py
    python benches/big_bodies.py --sizes 10,30 --compare-with /tmp/rs-before
"""

from __future__ import annotations

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


async def measure(
    server: Child, label: str, sizes: list[float], repeat: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    async def idle() -> None:
        await trio.sleep(2)

    _, idle_stats = await _probe_while(server, idle)
    rows.append({"server": label, "body MiB": 0, "status": "idle", "answer ms": 0.0, **idle_stats})
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        for size in sizes:
            created = await client.post("/sessions", json={})
            session_id = created.json()["session_id"]
            text = _WORDS * int(size * 2**20 / len(_WORDS))
            body = orjson.dumps({"messages": [{"role": "user", "content": text}]})
            del text

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
                    "body MiB": size,
                    "status": f"{response.status_code} {code}",
                    "answer ms": ms(elapsed),
                    **stats,
                }
            )
            print(table(rows[-1:]), flush=True)
    return rows


async def main(
    sizes: list[float], context_length: int, compare_with: Path | None, repeat: int
) -> Any:
    print(load_average())
    flags = ["--context-length", str(context_length), "--max-body-mb", "64"]
    rows: list[dict[str, Any]] = []
    async with child("emulator", emulator_command("--record-limit", "0")) as emulator:
        command = server_command([emulator.url], *flags)
        async with child("server", command, marker="rollout-session listening on") as server:
            rows += await measure(server, "now", sizes, repeat)
        if compare_with is not None:
            before = ["env", f"PYTHONPATH={compare_with}", *command]
            async with child("server-before", before, marker="rollout-session listening on") as b:
                rows += await measure(b, f"before ({compare_with})", sizes, repeat)
    print(table(rows))
    print(load_average())
    return rows


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", default="1,10,30", help="body sizes, MiB")
    parser.add_argument("--context-length", type=int, default=32768)
    parser.add_argument(
        "--compare-with", type=package_at, help="baseline: a package dir or a git revision"
    )
    parser.add_argument("--repeat", type=int, default=5, help="refusals per size, back to back")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    before = args.compare_with.resolve() if args.compare_with else None
    result = trio.run(main, sizes, args.context_length, before, args.repeat)
    write_json(args.json, result)
