"""The upstream client alone: CPU and latency per request of httpx's client,
httpcore's pool and the server's `WorkerClient`, with 1 and 64 warm keep-alive
connections (what the pool holds after a burst of 64 concurrent sessions).

The origin is a bare socket server in its own process answering every request
with a fixed 12 kB body at near-zero CPU; requests are 9 kB POSTs, one at a
time; 3 rounds, the median is shown. CPU is this process's (client) time.

    python benches/upstream_client.py
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import httpcore
import httpx
import trio

from rollout_session.engines.pool.client import WorkerClient

PAYLOAD = b'{"m":"' + b"b" * 9000 + b'"}'
ANSWER = b'{"x":"' + b"a" * 12000 + b'"}'
REQUESTS = 1500


def origin() -> None:
    response = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    response += b"content-length: %d\r\n\r\n" % len(ANSWER) + ANSWER

    def handle(conn: socket.socket) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
            head, _, rest = buffer.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                key, _, value = line.partition(b":")
                if key.strip().lower() == b"content-length":
                    length = int(value)
            while len(rest) < length:
                rest += conn.recv(65536)
            buffer = rest[length:]
            conn.sendall(response)

    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    while True:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


async def bench(call: Callable[[], Awaitable[None]], warm: int) -> tuple[float, float]:
    async with trio.open_nursery() as nursery:  # opens `warm` connections
        for _ in range(warm):
            nursery.start_soon(call)
    for _ in range(100):
        await call()
    latencies = []
    cpu = time.process_time()
    for _ in range(REQUESTS):
        started = time.perf_counter()
        await call()
        latencies.append(time.perf_counter() - started)
    return statistics.median(latencies) * 1e6, (time.process_time() - cpu) / REQUESTS * 1e6


Results = dict[tuple[str, int], list[tuple[float, float]]]


async def round_(base: str, results: Results) -> None:
    for warm in (1, 64):
        await compare(base, warm, results)


async def compare(base: str, warm: int, results: Results) -> None:
    headers = [(b"content-type", b"application/json"), (b"x-smg-routing-key", b"s")]
    client = httpx.AsyncClient(
        base_url=base,
        timeout=httpx.Timeout(600, connect=5),
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
    )

    async def via_httpx() -> None:
        await client.post("/v1/chat/completions", content=PAYLOAD, headers=dict(headers))

    results.setdefault(("httpx.AsyncClient", warm), []).append(await bench(via_httpx, warm))
    await client.aclose()
    pool = httpcore.AsyncConnectionPool(max_connections=64, max_keepalive_connections=64)
    url = httpcore.URL(base + "/v1/chat/completions")

    async def via_pool() -> None:
        await pool.request("POST", url, headers=headers, content=PAYLOAD)

    results.setdefault(("httpcore AsyncConnectionPool", warm), []).append(
        await bench(via_pool, warm)
    )
    await pool.aclose()
    worker = WorkerClient(base, max_connections=64, timeout_s=600, connect_timeout_s=5)

    async def via_worker_client() -> None:
        await worker.request(
            b"POST", "/v1/chat/completions", list(headers), PAYLOAD, max_bytes=1 << 20
        )

    results.setdefault(("WorkerClient", warm), []).append(await bench(via_worker_client, warm))
    await worker.aclose()


def main() -> None:
    process = subprocess.Popen(
        [sys.executable, __file__, "--origin"], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    base = f"http://127.0.0.1:{int(process.stdout.readline())}"
    results: Results = {}
    try:
        for _ in range(3):
            trio.run(round_, base, results)
    finally:
        process.kill()
    print("| client | warm connections | p50 µs | CPU µs/request |\n|---|---|---|---|")
    for (name, warm), values in results.items():
        p50 = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        print(f"| {name} | {warm} | {p50:.0f} | {cpu:.0f} |")


if __name__ == "__main__":
    origin() if "--origin" in sys.argv else main()
