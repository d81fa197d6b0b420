"""Shared helpers for the benchmarks in this directory (not a benchmark itself).

- `Child`: a separate process (emulator, session server, proxy, probe) started
  with its command line, found by its "listening on URL" line, stopped with
  SIGTERM; its CPU time and RSS are read from ``/proc``.
- `health_probe`: a separate process polling ``GET /health`` while a load runs,
  so the probe's own timing is not skewed by the load generator's event loop.
- `profile`: py-spy attached to a child for the measured window.
- percentiles, tables, JSON results, plots.

Scripts import this as ``_common`` (Python puts the script's directory first on
``sys.path``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import orjson
import trio

BENCHES = Path(__file__).resolve().parent
PYTHON = sys.executable
ROLLOUT = [PYTHON, "-m", "rollout_session"]
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_LOG_DIR = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
# Quieter children: no transformers advisory line on every start.
_CHILD_ENV = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"}


def tokenizer_path() -> str:
    """The bundled test tokenizer's directory (its home and name changed across
    versions: the emulator wing, once `rollout_session.testing`)."""
    try:
        import rollout_session.emulator as emulator
    except ImportError:
        import rollout_session.testing as emulator  # type: ignore[no-redef]

    find = getattr(emulator, "bundled_tokenizer_path", None) or emulator.test_tokenizer_path
    return str(find())


# What the session server adds to every request it forwards (turns._FORCED).
FORCED = {"logprobs": True, "return_meta_info": True, "no_stop_trim": False, "stream": False}


@functools.cache
def _chat_tokenizer() -> Any:
    from rollout_session.prompt.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_path())


def as_worker_request(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as the session server would forward it on a first turn: with
    the prompt's ``input_ids`` and the forced fields. Paths that talk to the
    worker directly send this: the emulator, like a worker behind a session
    server, never renders ``messages`` itself."""
    ids = _chat_tokenizer().first_turn(
        body["messages"], tools=body.get("tools"), kwargs=body.get("chat_template_kwargs") or {}
    )
    return {**body, **FORCED, "input_ids": ids}


# -- child processes ------------------------------------------------------------


def proc_stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds) for every process visible in /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK)
    return out


@dataclass
class CpuSample:
    cpu_s: float
    wall_s: float


@dataclass
class Child:
    """A benchmark child process; `url` comes from its "listening on" line."""

    name: str
    process: trio.Process
    url: str
    log: Path
    _stdout: list[bytes] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_s(self, stats: dict[int, tuple[int, float]] | None = None) -> float:
        """User + system CPU seconds so far of the process and its live
        descendants (e.g. worker processes a server starts), all threads;
        from `stats` (`proc_stats()`) when given."""
        stats = proc_stats() if stats is None else stats
        tree, total = {self.pid}, 0.0
        for pid, (ppid, cpu) in sorted(stats.items()):
            if pid in tree or ppid in tree:
                tree.add(pid)
                total += cpu
        return total if self.pid in stats else math.nan

    def main_cpu_s(self, stats: dict[int, tuple[int, float]] | None = None) -> float:
        """User + system CPU seconds so far of the process alone (all its
        threads; for the server: the event loop, without its validation
        processes); from `stats` (`proc_stats()`) when given."""
        stats = proc_stats() if stats is None else stats
        return stats.get(self.pid, (0, math.nan))[1]

    def memory_mib(self) -> tuple[float, float]:
        """(current RSS, peak RSS) in MiB."""
        values = {}
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) / 1024
        except OSError:
            return math.nan, math.nan
        return values.get("VmRSS", math.nan), values.get("VmHWM", math.nan)

    def reset_peak_memory(self) -> None:
        """Make the peak RSS (VmHWM) the current RSS, so a later
        `memory_mib` peak is what happened since (Linux ``clear_refs``)."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def sample(self) -> CpuSample:
        return CpuSample(self.cpu_s(), time.perf_counter())

    def cpu_share(self, since: CpuSample) -> float:
        """Cores used since `since` (1.0 = one core busy all the time)."""
        now = self.sample()
        return (now.cpu_s - since.cpu_s) / max(now.wall_s - since.wall_s, 1e-9)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            text = ""
        return "\n".join(text.splitlines()[-lines:])


async def _drain(stream: trio.abc.ReceiveStream, into: list[bytes]) -> None:
    async for chunk in stream:
        into.append(chunk)


@asynccontextmanager
async def child(
    name: str, command: Sequence[str], marker: str = "listening on", timeout_s: float = 120
) -> Any:
    """Start `command`, wait for its "... listening on URL" line, stop it on exit."""
    log = _LOG_DIR / f"{name}.log"
    with log.open("wb") as err:
        # A neutral working directory: `python -m` puts the cwd first on
        # sys.path, which would shadow a PYTHONPATH-selected package.
        process = await trio.lowlevel.open_process(
            list(command), stdout=subprocess.PIPE, stderr=err, env=_CHILD_ENV, cwd=_LOG_DIR
        )
    assert process.stdout is not None
    running: Child | None = None
    try:
        async with trio.open_nursery() as nursery:
            buffer = b""
            with trio.move_on_after(timeout_s):
                async for chunk in process.stdout:
                    buffer += chunk
                    complete = buffer.decode(errors="replace").split("\n")[:-1]
                    for line in complete:
                        if marker in line:
                            running = Child(name, process, line.rsplit(" ", 1)[1], log)
                            break
                    if running is not None:
                        break
            if running is None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} did not start: {buffer.decode()}\n{tail}")
            nursery.start_soon(_drain, process.stdout, running._stdout)
            try:
                yield running
            finally:
                nursery.cancel_scope.cancel()
    finally:
        await stop(process)


@asynccontextmanager
async def children(specs: Sequence[tuple[str, Sequence[str]]]) -> Any:
    """Start several children in parallel (each as `child`); yields them in order."""
    started: list[Child | None] = [None] * len(specs)
    all_up, release = trio.Event(), trio.Event()

    async def hold(i: int, name: str, command: Sequence[str]) -> None:
        async with child(name, command) as running:
            started[i] = running
            if all(c is not None for c in started):
                all_up.set()
            await release.wait()

    async with trio.open_nursery() as nursery:
        for i, (name, command) in enumerate(specs):
            nursery.start_soon(hold, i, name, command)
        await all_up.wait()
        try:
            yield [c for c in started if c is not None]
        finally:
            release.set()


async def stop(process: trio.Process, grace_s: float = 10) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace_s):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()


def emulator_command(*flags: str) -> list[str]:
    """An emulator process; an SGLang one launched, as a trainer launches it,
    with the SGLang parsers of the bundled templates (both write Qwen's
    ``<tool_call>`` JSON; qwen3's reasoning is ``<think>``), unless the flags
    name a parser: SGLang's chat route parses only with them."""
    extra: list[str] = []
    sglang = "vllm" not in flags
    if sglang and "--tool-call-parser" not in flags:
        extra += ["--tool-call-parser", "qwen25"]
    qwen3 = ("--chat-template", "qwen3") in itertools.pairwise(flags)
    if sglang and qwen3 and "--reasoning" in flags and "--reasoning-parser" not in flags:
        extra += ["--reasoning-parser", "qwen3"]
    return [*ROLLOUT, "emulator", "--port", "0", *flags, *extra]


def server_command(workers: Sequence[str], *flags: str) -> list[str]:
    cmd = [*ROLLOUT, "serve", "--port", "0", "--log-level", "warning"]
    for url in workers:
        cmd += ["--worker", url]
    return [*cmd, "--tokenizer", tokenizer_path(), *flags]


def bench_command(script: str, *flags: str) -> list[str]:
    return [PYTHON, str(BENCHES / script), *flags]


# -- bare ASGI (the raw proxy and the replayed upstream) -------------------------


async def serve_lifespan(receive: Any, send: Any) -> None:
    """Answer an ASGI lifespan scope: start-up and shutdown, nothing to do."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive: Any) -> bytes:
    """The whole request body of an ASGI http scope."""
    parts = []
    more = True
    while more:
        message = await receive()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


# -- /health probe ----------------------------------------------------------------


@dataclass
class Probe:
    """A running /health probe; `latencies` (seconds) is filled when it stops."""

    process: Child
    latencies: list[float] = field(default_factory=list)


@asynccontextmanager
async def health_probe(url: str, interval_s: float = 0.01) -> Any:
    """Poll ``url/health`` from a separate process while the block runs."""
    command = bench_command("_probe.py", f"{url}/health", "--interval-s", str(interval_s))
    async with child("health-probe", command, marker="probing") as running:
        probe = Probe(running)
        try:
            yield probe
        finally:
            running.process.send_signal(signal.SIGINT)
            with trio.move_on_after(30):
                await running.process.wait()
            await trio.sleep(0.05)
            text = b"".join(running._stdout).decode()
            for line in text.splitlines():
                if line.startswith("{"):
                    probe.latencies.extend(json.loads(line)["latencies_s"])


# -- machine load during a measurement ---------------------------------------------


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (from /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


@dataclass
class Window:
    """CPU use during a measured window: ours (listed children + this process)
    and everybody else's ("foreign": other work sharing the machine)."""

    ours: Sequence[Child]
    _wall: float = 0.0
    _machine: float = 0.0
    _self: float = 0.0
    _children: list[float] = field(default_factory=list)
    _mains: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._wall = time.perf_counter()
        self._machine = machine_busy_s()
        self._self = time.process_time()
        stats = proc_stats()  # one scan of /proc for every child
        self._children = [c.cpu_s(stats) for c in self.ours]
        self._mains = [c.main_cpu_s(stats) for c in self.ours]

    def finish(self) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        machine = machine_busy_s() - self._machine
        own = time.process_time() - self._self
        stats = proc_stats()
        kids = [
            c.cpu_s(stats) - before for c, before in zip(self.ours, self._children, strict=True)
        ]
        mains = [
            c.main_cpu_s(stats) - before for c, before in zip(self.ours, self._mains, strict=True)
        ]
        ours = own + sum(kids)
        return {
            "wall_s": wall,
            "self_cpu_s": own,
            **{f"{c.name}_cpu_s": k for c, k in zip(self.ours, kids, strict=True)},
            **{f"{c.name}_main_cpu_s": m for c, m in zip(self.ours, mains, strict=True)},
            "machine_cores": machine / wall,
            "foreign_cores": max(machine - ours, 0.0) / wall,
        }


# -- profiling --------------------------------------------------------------------


@asynccontextmanager
async def profile(target: Child | None, out: Path | None, rate: int = 100) -> Any:
    """Record `target` with py-spy (collapsed stacks) while the block runs."""
    if target is None or out is None:
        yield None
        return
    spy = shutil.which("py-spy") or str(Path(PYTHON).parent / "py-spy")
    out.parent.mkdir(parents=True, exist_ok=True)
    # --subprocesses: the validation worker processes are part of the server.
    command = [spy, "record", "-p", str(target.pid), "--subprocesses", "--format", "raw"]
    command += ["-r", str(rate)]
    command += ["--nonblocking", "-o", str(out)]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield out
    finally:
        process.send_signal(signal.SIGINT)
        with trio.move_on_after(30):
            await process.wait()


# -- statistics and output ------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Percentile `q` (0..100) by linear interpolation; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def ms(value: float) -> float:
    return value * 1000


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A Markdown table (also readable in a terminal)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def cell(value: Any) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "-"
            return f"{value:.3g}" if abs(value) < 0.01 else f"{value:,.2f}"
        return str(value)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| " + " | ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    return "\n".join(lines)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def write_json(path: Path | None, data: Any) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float))


# Built once: httpx builds one per client otherwise (unused here, plain HTTP),
# which cost the P1 load generator 27 % of its CPU with a client per agent.
_TLS = ssl.create_default_context()


def agent_client(timeout: float) -> httpx.AsyncClient:
    """One simulated agent's client: one connection, as a separate agent
    process would have. A pool shared by K agents scans all its connections
    on every request, which cost the P1 load generator 7-15 ms of CPU per
    chat at K=64, on the cores it shares with what is measured."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return httpx.AsyncClient(timeout=timeout, limits=limits, verify=_TLS)


# One token each (with or without a leading space) in the bundled tokenizer:
# filler text whose token count is its word count.
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "sigma", "model", "data")


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    message: _Message


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _AgentAnswer(msgspec.Struct):
    choices: list[_Choice]
    usage: _Usage = msgspec.field(default_factory=_Usage)


# What a load generator reads of a chat answer (the rest is skipped unparsed).
AGENT_ANSWER = msgspec.json.Decoder(_AgentAnswer)


class WorkerConversation:
    """A direct path's requests as the session server would send them, built
    the way it builds them: the first prompt rendered, each later one the
    previous ids, the sampled ids and the junction to the new messages
    (token-in/token-out, O(new tokens)), so the load generator does not
    re-render and re-tokenise the whole conversation every turn on the cores
    it shares with what is measured."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._answer: dict[str, Any] | None = None
        self._sampled: list[int] = []
        self._stopped = False

    def request(self, body: dict[str, Any], new_messages: int = 1) -> dict[str, Any]:
        """`body` with its ``input_ids``: `new_messages` are the messages the
        request appends after the last answer (ignored on a first turn)."""
        from rollout_session.prompt.junction import continuation

        tokenizer = _chat_tokenizer()
        tools, kwargs = body.get("tools"), body.get("chat_template_kwargs") or {}
        if self._answer is None:
            self.ids = tokenizer.first_turn(body["messages"], tools=tools, kwargs=kwargs)
        else:
            junction = tokenizer.junction(
                self._answer, body["messages"][-new_messages:], tools=tools, kwargs=kwargs
            )
            self.ids = [
                *self.ids,
                *self._sampled,
                *continuation(
                    self._sampled,
                    junction,
                    stopped=self._stopped,
                    special_ids=tokenizer.special_ids,
                ),
            ]
        return {**body, **FORCED, "input_ids": self.ids}

    def answered(self, answer: bytes) -> None:
        """Take the worker's answer to the last request (checked as the server
        checks it): its sampled ids."""
        from rollout_session.engines.sglang_chat.answer import parse_worker_answer
        from rollout_session.prompt.junction import STOPPED
        from rollout_session.prompt.messages import assistant_message

        decoded = parse_worker_answer(
            answer, sent_prompt_tokens=len(self.ids), vocab_size=_chat_tokenizer().vocab_size
        )
        self._sampled = decoded.ids.tolist()
        self._stopped = decoded.finish_reason in STOPPED
        self._answer = assistant_message(
            decoded.content, decoded.tool_calls, decoded.reasoning_content
        )


def package_at(value: str) -> Path:
    """``--compare-with``: a directory holding an exported ``rollout_session``
    package, or a git revision (``main``, ``HEAD~1``, a commit; on a branch,
    ``$(git merge-base HEAD main)`` is what the branch started from), exported
    once to ``/tmp/rs-<commit>`` with ``git archive``: a before/after run in
    one command."""
    path = Path(value)
    if path.is_dir():
        return path.resolve()
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--verify", f"{value}^{{commit}}"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except subprocess.CalledProcessError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a directory nor a git revision"
        ) from None
    target = Path(f"/tmp/rs-{commit[:12]}")
    if not (target / "rollout_session").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", commit, "rollout_session"], cwd=repo, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    print(f"--compare-with {value}: {commit[:12]}, exported at {target}", flush=True)
    return target


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line of a benchmark script, its docstring as the help."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def pyplot() -> Any:
    """matplotlib's pyplot with a non-interactive backend (imported on demand)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def after_tool_call(messages: list[Any], answer: bytes, result: str) -> list[Any]:
    """The agent's history after a chat answer (JSON bytes) that called a
    tool: the assistant's message, then `result` for its first call."""
    message = orjson.loads(answer)["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    return [
        *messages,
        {"role": "assistant", "content": message.get("content"), "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"] if calls else None, "content": result},
    ]
