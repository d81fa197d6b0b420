"""Oversize chat bodies: how fast they are refused, and what they do to ``/health``.

One agent posts a first turn whose user message is ``--sizes`` MiB of words
(default 1, 4, 10, 30) to a server whose model context is
``--context-length`` (32768) tokens, so every body is refused with 400
``context_length_exceeded``. While each request runs, a separate process
polls ``/health`` every 10 ms. Reported per size: the time to the refusal,
and ``/health`` p50 / p99 / max during it; the baseline is ``/health`` on the
same idle server in the same run.

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
    pct,
    server_command,
    table,
    write_json,
)

_WORDS = "lorem ipsum dolor sit amet "


async def _probe_while(url: str, work: Any) -> tuple[Any, list[float]]:
    async with health_probe(url) as probe:
        await trio.sleep(0.3)  # the probe's first answers: it is running
        result = await work()
        await trio.sleep(0.1)
    return result, probe.latencies


async def measure(server: Child, label: str, sizes: list[float]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    async def idle() -> None:
        await trio.sleep(2)

    _, idle_latencies = await _probe_while(server.url, idle)
    rows.append(
        {
            "server": label,
            "body MiB": 0,
            "status": "idle",
            "answer ms": 0.0,
            "/health p50 ms": ms(pct(idle_latencies, 50)),
            "/health p99 ms": ms(pct(idle_latencies, 99)),
            "/health max ms": ms(max(idle_latencies)),
        }
    )
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        for size in sizes:
            created = await client.post("/sessions", json={})
            session_id = created.json()["session_id"]
            text = _WORDS * int(size * 2**20 / len(_WORDS))
            body = orjson.dumps({"messages": [{"role": "user", "content": text}]})

            async def post(session_id: str = session_id, body: bytes = body) -> Any:
                started = time.perf_counter()
                response = await client.post(
                    f"/sessions/{session_id}/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                return response, time.perf_counter() - started

            (response, elapsed), latencies = await _probe_while(server.url, post)
            code = response.json().get("error", {}).get("code", response.status_code)
            rows.append(
                {
                    "server": label,
                    "body MiB": size,
                    "status": f"{response.status_code} {code}",
                    "answer ms": ms(elapsed),
                    "/health p50 ms": ms(pct(latencies, 50)),
                    "/health p99 ms": ms(pct(latencies, 99)),
                    "/health max ms": ms(max(latencies)),
                }
            )
            print(table(rows[-1:]), flush=True)
    return rows


async def main(sizes: list[float], context_length: int, compare_with: Path | None) -> Any:
    print(load_average())
    flags = ["--context-length", str(context_length)]
    rows: list[dict[str, Any]] = []
    async with child("emulator", emulator_command("--record-limit", "0")) as emulator:
        command = server_command([emulator.url], *flags)
        async with child("server", command, marker="rollout-session listening on") as server:
            rows += await measure(server, "now", sizes)
        if compare_with is not None:
            before = ["env", f"PYTHONPATH={compare_with}", *command]
            async with child("server-before", before, marker="rollout-session listening on") as b:
                rows += await measure(b, f"before ({compare_with})", sizes)
    print(table(rows))
    print(load_average())
    return rows


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", default="1,4,10,30", help="body sizes, MiB")
    parser.add_argument("--context-length", type=int, default=32768)
    parser.add_argument("--compare-with", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    before = args.compare_with.resolve() if args.compare_with else None
    result = trio.run(main, sizes, args.context_length, before)
    write_json(args.json, result)
