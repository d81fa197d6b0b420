"""Restart on a large journal: replay time, peak memory, journal size vs live data.

Builds, in a child process and with the real `Journal` API, a journal of
``--sessions`` sessions of ``--turns`` turns each: one ``create`` record per
session and one ``turn`` record per turn (36,000 × 28 ≈ 1M records by
default), every session still live. A turn is a tool-conversation turn:
``--prompt`` tokens appended (a tool result of ``--message-chars``
characters), ``--sampled`` sampled tokens with their logprobs, and the
assistant's message.

Then it restarts on that journal: a fresh child process opens it
(`Journal.open`: lock, streamed replay, start-up compaction if due) and
reports wall and CPU time, peak RSS, and RSS once open (what the restored
sessions themselves hold: peak minus that is what replay needed on top).
Then it compacts (one snapshot per live session, what a journal holds right
after a compaction: the live data) and restarts on the compacted journal.

Baseline in the same run: ``--compare-with DIR`` first restarts on the same
journal with the package exported at DIR first on the path, e.g. the commit
before streaming replay (a package with the journal in
``rollout_session/session/journal/``; for one from before that layout, run
that commit's own copy of this script with its package)::

    git archive <commit> rollout_session | tar -x -C /tmp/rs-before
    python benches/journal_restart.py --compare-with /tmp/rs-before

    python benches/journal_restart.py                       # 36k x 28 ≈ 1M records
    python benches/journal_restart.py --sessions 2000       # a quick look

The journal is read from the page cache (it was just written): a cold disk
adds its read time (the segment's size at the disk's sequential speed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BENCHES, bench_parser, load_average, package_at, table, write_json

PYTHON = sys.executable


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# --- children ---


def build(directory: str, sessions: int, turns: int, prompt: int, sampled: int, chars: int) -> None:
    import numpy as np
    import trio

    from rollout_session.session.journal.writer import Journal
    from rollout_session.session.session import Session
    from rollout_session.session.trajectory import Turn

    words = ("alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "sigma")
    text = " ".join(words[i % len(words)] for i in range(chars // 6 + 1))[:chars]

    def turn(journal: Journal, session: Session, rng: np.random.Generator) -> None:
        trajectory = session.trajectory
        keep = len(trajectory.turns)
        start = trajectory.length_after(keep)
        role = "user" if keep == 0 else "tool"
        request = [*session.messages, {"role": role, "content": text}]
        record = Turn(
            index=keep,
            prompt_start=start,
            completion_start=start + prompt,
            completion_end=start + prompt + sampled,
            messages_end=len(request) + 1,
            finish_reason="tool_calls",
            worker="http://10.0.0.5:30000",
            weight_version="3",
            cached_tokens=start,
            upstream_latency_s=0.5,
            created_at=time.time(),
        )
        trajectory.commit(
            keep_turns=keep,
            prompt_ids=rng.integers(0, 150_000, prompt, dtype=np.int32),
            sampled_ids=rng.integers(0, 150_000, sampled, dtype=np.int32),
            sampled_logprobs=-rng.exponential(1.0, sampled).astype(np.float32),
            turn=record,
        )
        call = {"function": {"name": "read_file", "arguments": {"path": f"src/m{keep}.py"}}}
        answer = {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
        session.messages = [*request, answer]
        session.model = "Qwen/Qwen3-8B"
        session.worker = "http://10.0.0.5:30000"
        journal.turn(session)

    async def main() -> None:
        journal, _ = await Journal.open(directory, fsync="never")
        rng = np.random.default_rng(0)
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            now = time.time()
            for i in range(sessions):
                session = Session(
                    id=f"episode-{i:07d}", metadata={"task": i}, created_at=now, last_active_at=now
                )
                journal.create(session)
                for _ in range(turns):
                    turn(journal, session, rng)
                if i % 64 == 0:
                    await journal.wait_durable()
            await journal.aclose()

    trio.run(main)


def restart(directory: str, compact: bool) -> None:
    import trio

    from rollout_session.session.journal.writer import Journal

    async def main() -> dict[str, Any]:
        wall, cpu = time.perf_counter(), time.process_time()
        journal, restored = await Journal.open(directory, fsync="never")
        result: dict[str, Any] = {
            "open_s": time.perf_counter() - wall,
            "cpu_s": time.process_time() - cpu,
            "sessions": len(restored),
            "turns": sum(len(s.trajectory.turns) for s in restored),
            "rss_open": _rss(),
        }
        if compact:
            async with trio.open_nursery() as nursery:
                await nursery.start(journal.run)
                await journal.compact()
                await journal.aclose()
        else:
            await journal.aclose()
        return result

    result = trio.run(main)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result), flush=True)


# --- the run ---


def run_child(args: list[str], package: Path | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = f"{package}{os.pathsep}{env.get('PYTHONPATH', '')}"
    command = [PYTHON, str(BENCHES / "journal_restart.py"), "--child", *args]
    # A neutral directory: the working tree must not shadow --compare-with.
    neutral = tempfile.gettempdir()
    out = subprocess.run(command, env=env, cwd=neutral, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def segment_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("journal-*.log"))


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--sessions", type=int, default=36_000)
    parser.add_argument("--turns", type=int, default=28)
    parser.add_argument("--prompt", type=int, default=60, help="tokens appended per turn")
    parser.add_argument("--sampled", type=int, default=40, help="tokens sampled per turn")
    parser.add_argument("--message-chars", type=int, default=400, help="tool result size")
    parser.add_argument("--dir", type=Path, help="where to build (default: a temp dir)")
    parser.add_argument(
        "--compare-with", type=package_at, help="baseline: a package dir or a git revision"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, *rest = args.child
        if mode == "build":
            build(rest[0], *map(int, rest[1:]))
        else:
            restart(rest[0], mode == "compact")
        return

    root = args.dir or Path(tempfile.mkdtemp(prefix="journal-restart-"))
    directory = root / "journal"
    shutil.rmtree(directory, ignore_errors=True)
    print(load_average(), flush=True)
    started = time.perf_counter()
    run_child(
        [
            "build",
            str(directory),
            str(args.sessions),
            str(args.turns),
            str(args.prompt),
            str(args.sampled),
            str(args.message_chars),
        ]
    )
    records = args.sessions * (args.turns + 1)
    full = segment_bytes(directory)
    print(
        f"built {records:,} records, {full / 2**20:,.0f} MiB in "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )
    rows = []

    def row(label: str, result: dict[str, Any], size: int, n: int) -> None:
        rows.append(
            {
                "restart": label,
                "records": n,
                "journal MiB": size / 2**20,
                "open s": result.get("open_s", float("nan")),
                "CPU s": result.get("cpu_s", float("nan")),
                "records/s": n / result["open_s"] if "open_s" in result else float("nan"),
                "RSS open MiB": result.get("rss_open", 0) / 2**20,
                "peak RSS MiB": result.get("peak_rss", 0) / 2**20,
            }
        )
        print(table(rows[-1:]), flush=True)

    if args.compare_with is not None:
        row("baseline", run_child(["open", str(directory)], args.compare_with), full, records)
    row("this tree", run_child(["compact", str(directory)]), full, records)
    compacted = segment_bytes(directory)
    row("compacted", run_child(["open", str(directory)]), compacted, args.sessions)
    print()
    print(table(rows))
    print(f"\njournal / live data (compacted): {full / compacted:.2f}")
    write_json(args.json, {"rows": rows, "bytes": full, "compacted_bytes": compacted})
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
