"""Serving on hypercorn's internals: what `start_server` buys over ``hypercorn.trio.serve``.

``rollout_session/http/serving.py`` serves apps on hypercorn's trio
internals rather than its public ``hypercorn.trio.serve``, for a connection
cap with an accept loop that waits when out of descriptors, and for a
connection that ends when its client closes it. This measures both against
the public API in the same run: the same tiny plain ASGI app (no Quart: the
serving only), the same hypercorn ``Config`` (``hypercorn_config``: 75 s
keep-alive), each server its own process on 127.0.0.1 (port 0), started
fresh for every measurement, variants alternating, ``--repeats`` times (the
tables show the median and the range; the JSON keeps every run). Three
measurements (``--tests``):

- ``idle``: ``--idle-clients`` clients each send one request on a keep-alive
  connection, stay idle ``--idle-s``, then close it. ``--settle-s`` later,
  the TCP sockets the server process still holds are counted from
  ``/proc/PID/fd`` and ``/proc/net/tcp`` (a closed client's socket stays in
  CLOSE_WAIT until the server closes it);
- ``limit``: the server process's descriptor limit is ``--nofile``
  (``setrlimit`` in the server's process only), and its app opens a file for
  each request (``/dev/null``, held ``--work-ms``: the app's own descriptor
  need, as an upstream connection or a journal file). ``--clients``
  concurrent clients send one request each; counted: 500 answers (the app
  could not open its file), failed requests (connection errors) and
  requests unanswered after ``--budget-s``;
- ``hold``: the same limit, ``--hold-clients`` clients each send one request
  and keep their connection open for ``--hold-s``; counted: EMFILE records
  the server logged in that time (and its stderr lines: tracebacks
  included), its CPU time, requests answered.

Variants: ``start_server`` with ``max_connections=--max-connections``
(``idle``: its default, 4096, so the cap plays no part), and
``hypercorn.trio.serve``; ``limit`` and ``hold`` also run ``start_server``
with its default cap, above the descriptor limit (``--no-uncapped`` drops
it): its accept loop on EMFILE without the cap.

    python benches/serving_internals.py
    python benches/serving_internals.py --repeats 1 --hold-s 3 --tests limit,hold
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import json
import logging
import os
import resource
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from _common import (
    Child,
    bench_command,
    bench_parser,
    child,
    load_average,
    read_body,
    serve_lifespan,
    table,
    write_json,
)

MARKER = "serving-internals listening on"
TESTS = ("idle", "limit", "hold")
DEFAULT_CAP = 4096  # start_server's own default max_connections
_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


# -- the server process ----------------------------------------------------------------


_COUNTS = {"open_ok": 0, "open_fail": 0, "log_records": 0, "emfile_records": 0}


class _CountRecords(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _COUNTS["log_records"] += 1
        text = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        if (
            "EMFILE" in text
            or "Too many open files" in text
            or getattr(exc, "errno", None) == errno.EMFILE
        ):
            _COUNTS["emfile_records"] += 1


def _make_app(work_s: float) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        await read_body(receive)
        status, body = 200, b"ok"
        if scope["path"] == "/file":
            try:
                fd = os.open(os.devnull, os.O_RDONLY)  # a descriptor, as a socket or a file
            except OSError:
                _COUNTS["open_fail"] += 1
                status, body = 500, b"cannot open a file"
            else:
                try:
                    _COUNTS["open_ok"] += 1
                    await trio.sleep(work_s)
                finally:
                    os.close(fd)
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


async def _serve_child(variant: str, cap: int, work_s: float, lifetime_s: float) -> None:
    from hypercorn.trio import serve

    from rollout_session.http.serving import hypercorn_config, start_server

    app = _make_app(work_s)
    parent = os.getppid()
    stop = trio.Event()
    with trio.move_on_after(lifetime_s):  # never outlives a bench that died
        async with trio.open_nursery() as nursery:
            if variant == "public":
                config = hypercorn_config("127.0.0.1", 0)

                async def public(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                    await serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)

                url = (await nursery.start(public))[0]
            else:
                url = (await start_server(nursery, app, max_connections=cap)).url
            print(f"{MARKER} {url}", flush=True)
            # Counters on stdout (already open: no descriptor needed to report).
            while os.getppid() == parent:
                print(json.dumps(_COUNTS), flush=True)
                await trio.sleep(0.1)
            stop.set()
            nursery.cancel_scope.cancel()


def child_main(args: argparse.Namespace) -> None:
    if args.child_nofile:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.child_nofile, hard))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().addHandler(_CountRecords())
    trio.run(_serve_child, args.child, args.child_cap, args.work_ms / 1000, args.child_lifetime_s)


# -- the bench ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str  # start_server | public
    cap: int

    @property
    def label(self) -> str:
        if self.name == "public":
            return "hypercorn.trio.serve"
        return f"start_server (max_connections={self.cap})"


def variants(test: str, args: argparse.Namespace) -> list[Variant]:
    if test == "idle":
        return [Variant("start_server", DEFAULT_CAP), Variant("public", 0)]
    out = [Variant("start_server", args.max_connections), Variant("public", 0)]
    if not args.no_uncapped and args.max_connections != DEFAULT_CAP:
        out.append(Variant("start_server", DEFAULT_CAP))
    return out


def server_command(variant: Variant, nofile: int, args: argparse.Namespace) -> list[str]:
    return bench_command(
        "serving_internals.py",
        "--child",
        variant.name,
        "--child-cap",
        str(variant.cap),
        "--child-nofile",
        str(nofile),
        "--work-ms",
        str(args.work_ms),
        "--child-lifetime-s",
        str(args.child_lifetime_s),
    )


def tcp_sockets(pid: int) -> Counter[str]:
    """The TCP sockets process `pid` holds, by state (its fds, /proc/net/tcp)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return Counter()
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    states: dict[str, str] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[9] in inodes:
                states[fields[9]] = _STATES.get(fields[3], fields[3])
    return Counter(states.values())


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def counters(server: Child) -> dict[str, int]:
    """The server's latest counters line (it prints one every 100 ms)."""
    for line in reversed(b"".join(server._stdout).decode(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                found: dict[str, int] = json.loads(line)
            except ValueError:
                continue
            return found
    return {}


def stderr_lines(server: Child) -> int:
    try:
        return len(server.log.read_text(errors="replace").splitlines())
    except OSError:
        return 0


async def get(stream: trio.SocketStream, path: str) -> int:
    """One GET on a keep-alive connection; the answer's status."""
    await stream.send_all(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode())
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("closed before the answer")
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(rest) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("closed in the answer's body")
        rest += chunk
    return int(lines[0].split()[1])


async def connect(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


def _outcome(result: Counter[str], status: int) -> None:
    result["200" if status == 200 else "500" if status == 500 else "other"] += 1


async def measure_idle(server: Child, args: argparse.Namespace) -> dict[str, Any]:
    before = tcp_sockets(server.pid)
    result: Counter[str] = Counter()

    async def one() -> None:
        try:
            stream = await connect(server.url)
            async with stream:
                _outcome(result, await get(stream, "/"))
                await trio.sleep(args.idle_s)  # idle: the exchange ended on both sides
        except (OSError, trio.BrokenResourceError):
            result["failed"] += 1

    with trio.move_on_after(args.budget_s):
        async with trio.open_nursery() as nursery:
            for _ in range(args.idle_clients):
                nursery.start_soon(one)
    await trio.sleep(args.settle_s)
    after = tcp_sockets(server.pid)
    held = sum(n for state, n in after.items() if state != "LISTEN")
    held -= sum(n for state, n in before.items() if state != "LISTEN")
    return {
        "answered": result["200"],
        "failed": result["failed"] + result["other"],
        "sockets held": held,
        "CLOSE_WAIT": after["CLOSE_WAIT"] - before["CLOSE_WAIT"],
    }


async def measure_limit(server: Child, args: argparse.Namespace) -> dict[str, Any]:
    result: Counter[str] = Counter()
    finished: list[float] = []
    started = time.perf_counter()

    async def one() -> None:
        try:
            stream = await connect(server.url)
            async with stream:
                _outcome(result, await get(stream, "/file"))
        except (OSError, trio.BrokenResourceError):
            result["failed"] += 1
        finished.append(time.perf_counter() - started)

    with trio.move_on_after(args.budget_s):
        async with trio.open_nursery() as nursery:
            for _ in range(args.clients):
                nursery.start_soon(one)
    await trio.sleep(0.3)  # the next counters line
    counts = counters(server)
    done = result["200"] + result["500"] + result["other"] + result["failed"]
    return {
        "200": result["200"],
        "500": result["500"],
        "failed": result["failed"] + result["other"],
        "unanswered": args.clients - done,
        "last answer s": max(finished, default=float("nan")),
        "EMFILE records": counts.get("emfile_records", -1),
    }


async def measure_hold(server: Child, args: argparse.Namespace) -> dict[str, Any]:
    result: Counter[str] = Counter()
    cpu_before = server.cpu_s()
    lines_before = stderr_lines(server)
    deadline = trio.current_time() + args.hold_s
    peak_fds = 0

    async def one() -> None:
        # Held a little past the deadline: the server is read at the deadline.
        with trio.move_on_at(deadline + 0.5):
            try:
                stream = await connect(server.url)
                async with stream:
                    _outcome(result, await get(stream, "/"))
                    await trio.sleep_until(deadline + 0.5)  # hold the connection
            except (OSError, trio.BrokenResourceError):
                result["failed"] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(args.hold_clients):
            nursery.start_soon(one)
        while trio.current_time() < deadline:  # bounded by the deadline
            peak_fds = max(peak_fds, open_fds(server.pid))
            await trio.sleep(0.5)
        # Read at the deadline, before the held connections close.
        await trio.sleep(0.15)  # the next counters line
        counts = counters(server)
        cpu = server.cpu_s() - cpu_before
        lines = stderr_lines(server) - lines_before
        answered, failed = result["200"], result["failed"] + result["other"]
    return {
        "answered": answered,
        "failed": failed,
        "peak fds": peak_fds,
        "EMFILE records": counts.get("emfile_records", -1),
        "stderr lines": lines,
        "server CPU s": cpu,
    }


MEASURES = {"idle": measure_idle, "limit": measure_limit, "hold": measure_hold}
# Shown per run, and per variant in the summary: median (min-max) over the repeats.
SHOWN = {
    "idle": ["sockets held", "CLOSE_WAIT", "answered", "failed"],
    "limit": ["500", "failed", "unanswered", "200", "last answer s", "EMFILE records"],
    "hold": ["EMFILE records", "stderr lines", "server CPU s", "answered", "peak fds"],
}


def _fmt(value: float) -> str:
    if value != value:  # nan
        return "-"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def summary(test: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for label in dict.fromkeys(r["variant"] for r in runs):
        group = [r for r in runs if r["variant"] == label]
        row: dict[str, Any] = {"variant": label, "runs": len(group)}
        for key in SHOWN[test]:
            values = [r[key] for r in group]
            row[key] = (
                f"{_fmt(statistics.median(values))} ({_fmt(min(values))}-{_fmt(max(values))})"
            )
        rows.append(row)
    return rows


async def main(args: argparse.Namespace) -> dict[str, Any]:
    print(load_average())
    versions = {
        "hypercorn": importlib.metadata.version("hypercorn"),
        "trio": importlib.metadata.version("trio"),
    }
    print(f"hypercorn {versions['hypercorn']}, trio {versions['trio']}, repeats {args.repeats}")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out: dict[str, Any] = {
        "versions": versions,
        "settings": settings,
        "load_before": os.getloadavg(),
        "tests": {},
    }
    for test in args.tests:
        nofile = 0 if test == "idle" else args.nofile
        runs: list[dict[str, Any]] = []
        for rep in range(args.repeats):
            order = variants(test, args)
            if rep % 2:
                order.reverse()  # alternate which variant goes first
            for variant in order:
                name = f"{test}-{variant.name}-{variant.cap}-{rep}"
                async with child(name, server_command(variant, nofile, args), MARKER) as server:
                    row = {"test": test, "variant": variant.label, "repeat": rep}
                    row |= await MEASURES[test](server, args)
                runs.append(row)
                shown = ", ".join(f"{k} {_fmt(row[k])}" for k in SHOWN[test])
                print(f"{test} {rep + 1}/{args.repeats} {variant.label}: {shown}", flush=True)
        print()
        if test == "idle":
            print(
                f"## idle: {args.idle_clients} clients closed idle keep-alive connections; "
                f"TCP sockets the server still held {args.settle_s:g} s later"
            )
        elif test == "limit":
            print(
                f"## limit: {args.clients} concurrent requests, server limited to "
                f"{args.nofile} descriptors, app opens a file per request "
                f"({args.work_ms:g} ms); budget {args.budget_s:g} s"
            )
        else:
            print(
                f"## hold: {args.hold_clients} clients holding connections for "
                f"{args.hold_s:g} s, server limited to {args.nofile} descriptors"
            )
        rows = summary(test, runs)
        print(table(rows), flush=True)
        print()
        out["tests"][test] = {"runs": runs, "summary": rows}
    print(load_average())
    out["load_after"] = os.getloadavg()
    return out


def parse_args() -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--tests", type=lambda s: s.split(","), default=list(TESTS))
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant; median shown")
    parser.add_argument("--idle-clients", type=int, default=200)
    parser.add_argument("--idle-s", type=float, default=0.2, help="idle before the close")
    parser.add_argument("--settle-s", type=float, default=1.0, help="wait after the closes")
    parser.add_argument("--nofile", type=int, default=256, help="server's descriptor limit")
    parser.add_argument("--max-connections", type=int, default=100, help="start_server's cap")
    parser.add_argument("--no-uncapped", action="store_true", help="skip the default-cap run")
    parser.add_argument("--clients", type=int, default=600, help="limit: concurrent clients")
    parser.add_argument("--work-ms", type=float, default=50, help="limit: file held per request")
    parser.add_argument("--budget-s", type=float, default=30, help="idle/limit: time bound")
    parser.add_argument("--hold-clients", type=int, default=400)
    parser.add_argument("--hold-s", type=float, default=8)
    parser.add_argument("--json", type=Path)
    # The server process (this script started by itself).
    parser.add_argument("--child", choices=["start_server", "public"], help=argparse.SUPPRESS)
    parser.add_argument("--child-cap", type=int, default=DEFAULT_CAP, help=argparse.SUPPRESS)
    parser.add_argument("--child-nofile", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-lifetime-s", type=float, default=600, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.child:
        child_main(arguments)
        sys.exit(0)
    unknown = set(arguments.tests) - set(TESTS)
    if unknown:
        sys.exit(f"unknown tests {sorted(unknown)}: pick from {','.join(TESTS)}")
    need = max(arguments.idle_clients, arguments.clients, arguments.hold_clients) + 64
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        sys.exit(f"this process needs {need} descriptors for its clients (limit {soft})")
    result = trio.run(main, arguments)
    write_json(arguments.json, result)
