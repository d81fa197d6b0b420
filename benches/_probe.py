"""Health probe process used by the benchmarks (see `_common.health_probe`).

Polls one URL with GET on one keep-alive connection, one request at a time,
every ``--interval-s``, until SIGINT/SIGTERM (or ``--max-s``); then prints one
JSON line ``{"latencies_s": [...], "errors": n}``. Runs in its own process so
the load generator's event loop does not add to the latencies it reports.

    python benches/_probe.py http://127.0.0.1:8000/health --interval-s 0.01
"""

from __future__ import annotations

import argparse
import json
import signal
import time

import httpx
import trio


async def main(args: argparse.Namespace) -> None:
    latencies: list[float] = []
    errors = 0
    async with httpx.AsyncClient(timeout=30) as client:
        print("probing", args.url, flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def poll() -> None:
                    nonlocal errors
                    deadline = trio.current_time() + args.max_s
                    while trio.current_time() < deadline:
                        started = time.perf_counter()
                        try:
                            response = await client.get(args.url)
                            response.raise_for_status()
                        except httpx.HTTPError:
                            errors += 1
                        else:
                            latencies.append(time.perf_counter() - started)
                        await trio.sleep(args.interval_s)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(poll)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break
    print(json.dumps({"latencies_s": latencies, "errors": errors}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("--interval-s", type=float, default=0.01)
    parser.add_argument("--max-s", type=float, default=900.0, help="stop by itself after this")
    trio.run(main, parser.parse_args())
