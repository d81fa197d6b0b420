"""P4 memory: resident memory per stored token, 10k sessions x 4k tokens.

Method: one prototype agent conversation (tool calls and ~240-word tool
results, like P3) is run against a real emulator process until its trajectory
holds ``--tokens`` (4096) tokens, each turn run by the server's own
`TurnRunner` in this process (the ``sglang-chat`` engine with a worker pool
of the emulator, benches/_turns.py); the agent's bodies and the worker's
answers are recorded. Then ``--sessions`` (10,000) sessions are built in
this process by replaying it through the real turn path: for every session
and turn, `TurnRunner.run` with the recorded agent body (`parse_chat_request`:
fresh message objects, as the server gets them; `plan_turn`) and a
`ReplayEngine` answering with the recorded worker answer (`check_answer`:
fresh arrays), committed through the session store (`commit_turn` →
`Trajectory.commit`).

Every turn is planned, as the server plans it: earlier versions reused the
prototype's plans (``--replan`` planned each turn, and is gone), so "build s"
now counts planning (each turn's new messages rendered and tokenised) and the
runner's own work (claim, release, metrics) besides parsing, validation and
the commit. The memory figures count the same objects as before, but for
each session's template kwargs (``{}``), no longer shared between sessions.

Reported: RSS growth (``/proc/self/status`` VmRSS, after ``gc.collect()`` and
glibc ``malloc_trim(0)``, so free heap left by start-up is not counted as reuse)
divided by the stored tokens, next to the token arrays' own bytes (used and
allocated) and a deep size of what else a session holds (messages, turn
records). Baseline in the same run: the same tokens kept as Python lists
(what docs/api.md#history-rules rules out), for ``--baseline-sessions`` sessions.

    python benches/memory.py                          # 10k x 4k
    python benches/memory.py --sessions 1000 --tokens 4096
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import trio
from _common import (
    after_tool_call,
    bench_parser,
    child,
    emulator_command,
    load_average,
    table,
    tokenizer_path,
    write_json,
)
from _turns import REPLAY_WORKER, emulator_runner, replay_runner
from replay_engine import Replay
from tito_cost import TOOLS, tool_result

from rollout_session import Settings
from rollout_session.engines.base import EngineRequest, EngineSession
from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer
from rollout_session.session.session import Session
from rollout_session.turn.runner import TurnRunner


def trim() -> None:
    """Collect garbage and hand free heap pages back to the OS (glibc), so
    RSS differences count live objects, not memory freed earlier."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_bytes() -> int:
    trim()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def deep_size(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of `obj` and everything it references (containers, dataclasses)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, list | tuple | set | frozenset):
        size += sum(deep_size(v, seen) for v in obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        size += sum(deep_size(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    else:
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if hasattr(obj, name) and not name.startswith("__"):
                    size += deep_size(getattr(obj, name), seen)
    return size


def arrays_used(tokens: Any) -> int:
    """Bytes the token arrays need without slack: ids + sampled logprobs +
    runs (compact storage), or ids + logprobs + mask per token (the 9-byte
    layout of earlier versions, when benchmarking an exported old commit)."""
    if hasattr(tokens, "num_sampled"):
        return 4 * len(tokens) + 4 * tokens.num_sampled + 8 * len(tokens.runs())
    return 9 * len(tokens)


def messages_size(session: Any) -> int:
    """Bytes of the stored conversation as the session holds it."""
    conversation = getattr(session, "conversation", None)
    if conversation is not None:
        return deep_size(conversation)
    return deep_size(session.messages)


@dataclasses.dataclass
class Recorded:
    body: bytes  # the agent's request
    answer: bytes  # the worker's answer


async def prototype(
    emulator_url: str, tokenizer: ChatTokenizer, tokens: int, words: int
) -> tuple[list[Recorded], Session, int | None]:
    """Run one real conversation until it stores `tokens` tokens; return its
    turns, the session and the served model's context length."""
    turns: list[Recorded] = []
    async with emulator_runner(emulator_url, tokenizer) as runner:
        session = await runner.store.create(None, metadata=None, ttl_s=None)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful coding agent. " * 20},
            {"role": "user", "content": "Find out why the build fails and fix it."},
        ]
        turn = 0
        while len(session.trajectory) < tokens:
            turn += 1
            body = orjson.dumps(
                {"messages": messages, "tools": TOOLS, "tool_choice": "required", "seed": turn}
            )
            outcome = await runner.run(session.id, body)
            if outcome.reply.status != 200:
                raise SystemExit(f"turn {turn}: worker said {outcome.reply.status}")
            turns.append(Recorded(body, outcome.reply.body))
            messages = after_tool_call(messages, outcome.reply.body, tool_result(turn, words))
        context_length = runner.model.context_length
    return turns, session, context_length


@dataclasses.dataclass
class Replayer:
    """The replay engine's source: the recorded answer of the turn being run."""

    answer: bytes = b""

    def __call__(self, session: EngineSession, request: EngineRequest) -> Replay:
        return Replay.of_answer(self.answer, request)


async def build(
    runner: TurnRunner, replayer: Replayer, recorded: list[Recorded], sessions: int
) -> list[Session]:
    built = []
    for _ in range(sessions):
        session = await runner.store.create(None, metadata=None, ttl_s=None)
        for rec in recorded:
            replayer.answer = rec.answer
            outcome = await runner.run(session.id, rec.body)
            assert outcome.turn is not None
        built.append(session)
    return built


async def main(args: argparse.Namespace) -> None:
    print(f"{load_average()}; {args.sessions} sessions x >= {args.tokens} tokens")
    tokenizer = load_tokenizer(tokenizer_path())
    async with child("emulator", emulator_command("--record-limit", "0")) as emulator:
        recorded, proto, context_length = await prototype(
            emulator.url, tokenizer, args.tokens, args.tool_result_words
        )
    per_session = len(proto.trajectory)
    print(f"prototype: {len(recorded)} turns, {per_session} tokens per session")
    replayer = Replayer()
    runner = replay_runner(
        replayer,
        tokenizer,
        Settings(workers=(REPLAY_WORKER,), context_length=context_length),
    )
    # Replayed, the turns commit what the prototype's did.
    check = await build(runner, replayer, recorded, 1)
    assert np.array_equal(check[0].trajectory.tokens.ids, proto.trajectory.tokens.ids)
    runner.store.forget(await runner.store.close(check[0].id))
    del proto, check

    gc.collect()
    before = rss_bytes()
    started = time.perf_counter()
    sessions = await build(runner, replayer, recorded, args.sessions)
    build_s = time.perf_counter() - started
    gc.collect()
    after = rss_bytes()
    # A full collection has to walk every tracked object the sessions hold.
    started = time.perf_counter()
    gc.collect()
    gc_pause_ms = 1000 * (time.perf_counter() - started)
    tracked = len(gc.get_objects())
    stored = sum(len(s.trajectory) for s in sessions)
    used = sum(arrays_used(s.trajectory.tokens) for s in sessions)
    sampled = sum(int(s.trajectory.tokens.mask.sum()) for s in sessions)
    arrays_alloc = sum(s.trajectory.tokens.nbytes for s in sessions)
    sample = sessions[len(sessions) // 2]
    messages_each = messages_size(sample)
    # What a compact store of the same history would take
    # (docs/performance.md#p4-memory-per-stored-token).
    messages_json = len(orjson.dumps(sample.messages))
    turns_each = deep_size(sample.trajectory.turns)
    session_each = deep_size(sample) - deep_size(sample.trajectory.tokens)
    rows = [
        {
            "storage": "session server (numpy arrays)",
            "sessions": len(sessions),
            "tokens": stored,
            "RSS growth MiB": (after - before) / 2**20,
            "RSS B/token": (after - before) / stored,
            "arrays used B/token": used / stored,
            "sampled tokens %": 100 * sampled / stored,
            "arrays allocated B/token": arrays_alloc / stored,
            "messages B/token": messages_each * len(sessions) / stored,
            "messages as JSON B/token": messages_json * len(sessions) / stored,
            "turn records B/token": turns_each * len(sessions) / stored,
            "session total (deep) B/token": (session_each * len(sessions) + arrays_alloc) / stored,
            "build s": build_s,
            "full gc ms": gc_pause_ms,
            "gc-tracked objects": tracked,
        }
    ]
    print(table(rows))

    # Baseline: the same tokens as Python lists, for a subset of sessions.
    subset = sessions[: args.baseline_sessions]
    gc.collect()
    before = rss_bytes()
    lists = [
        (
            s.trajectory.tokens.ids.tolist(),
            s.trajectory.tokens.logprobs.tolist(),
            s.trajectory.tokens.mask.tolist(),
        )
        for s in subset
    ]
    gc.collect()
    after = rss_bytes()
    listed = sum(len(ids) for ids, _, _ in lists)
    rows.append(
        {
            "storage": "baseline: Python lists (tokens only)",
            "sessions": len(lists),
            "tokens": listed,
            "RSS growth MiB": (after - before) / 2**20,
            "RSS B/token": (after - before) / max(listed, 1),
        }
    )
    del lists
    print()
    print(load_average())
    print(table(rows, _COLUMNS))
    print(f"target: <= 16 B/token (measured {rows[0]['RSS B/token']:.2f} B/token)")
    write_json(
        args.json,
        {"args": {k: str(v) for k, v in vars(args).items()}, "load": load_average(), "rows": rows},
    )


_COLUMNS = [
    "storage",
    "sessions",
    "tokens",
    "RSS growth MiB",
    "RSS B/token",
    "arrays used B/token",
    "sampled tokens %",
    "arrays allocated B/token",
    "messages B/token",
    "messages as JSON B/token",
    "turn records B/token",
    "session total (deep) B/token",
    "build s",
    "full gc ms",
    "gc-tracked objects",
]


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per session (at least)")
    parser.add_argument("--tool-result-words", type=int, default=240)
    parser.add_argument("--baseline-sessions", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    trio.run(main, parser.parse_args())
