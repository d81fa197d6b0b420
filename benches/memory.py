"""P4 memory: resident memory per stored token, 10k sessions x 4k tokens.

Method: one prototype agent conversation (tool calls and ~240-word tool
results, like P3) is run against a real emulator process until its trajectory
holds ``--tokens`` (4096) tokens, through the server's own turn functions.
Then ``--sessions`` (10,000) sessions are built in this process through the
real commit path: for every session and turn, the recorded request body is
parsed with `parse_chat_request` (fresh message objects, as the server gets
them), the recorded worker answer with `parse_worker_answer` (fresh arrays),
and `commit_turn` → `Trajectory.commit` stores it. Only the prompt ids of the
plan are reused from the prototype (they are transient: the commit copies
them into the session's arrays), which saves a template render per turn;
``--replan`` calls `plan_turn` for every turn instead.

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

import httpx
import orjson
import trio
from _common import (
    bench_parser,
    child,
    emulator_command,
    load_average,
    table,
    tokenizer_path,
    write_json,
)
from tito_cost import TOOLS, tool_result, upstream_payload

from rollout_session import Settings
from rollout_session.engines.answer import parse_worker_answer
from rollout_session.engines.upstream import UpstreamReply
from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer
from rollout_session.session.commit import commit_turn
from rollout_session.session.session import SessionRegistry
from rollout_session.turn.request import parse_chat_request
from rollout_session.turn.runner import TurnPolicy, plan_turn


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
    body: bytes
    plan: Any
    answer: bytes
    reply: UpstreamReply


async def prototype(
    emulator_url: str, tokenizer: ChatTokenizer, policy: TurnPolicy, tokens: int, words: int
) -> tuple[list[Recorded], Any]:
    """Run one real conversation until it stores `tokens` tokens."""
    session = SessionRegistry().create()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent. " * 20},
        {"role": "user", "content": "Find out why the build fails and fix it."},
    ]
    turns: list[Recorded] = []
    async with httpx.AsyncClient(timeout=300) as client:
        turn = 0
        while len(session.trajectory) < tokens:
            turn += 1
            body = orjson.dumps(
                {"messages": messages, "tools": TOOLS, "tool_choice": "required", "seed": turn}
            )
            request = parse_chat_request(body)
            plan = plan_turn(session, request, tokenizer, policy)
            response = await client.post(
                f"{emulator_url}/v1/chat/completions",
                content=upstream_payload(request, plan),
                headers={"content-type": "application/json"},
            )
            response.raise_for_status()
            reply = UpstreamReply(200, [], response.content, emulator_url, 0.05)
            answer = parse_worker_answer(
                reply.body, sent_prompt_tokens=len(plan.input_ids), vocab_size=tokenizer.vocab_size
            )
            now = time.time()
            slot = session.claim(now)
            commit_turn(session, slot, plan, answer, reply, now)
            session.release(slot, now)
            turns.append(Recorded(body, plan, response.content, reply))
            call = orjson.loads(response.content)["choices"][0]["message"]
            messages = [
                *messages,
                {
                    "role": "assistant",
                    "content": call.get("content"),
                    "tool_calls": call.get("tool_calls"),
                },
                {
                    "role": "tool",
                    "tool_call_id": (call.get("tool_calls") or [{}])[0].get("id"),
                    "content": tool_result(turn, words),
                },
            ]
    return turns, session


def build(
    tokenizer: ChatTokenizer,
    policy: TurnPolicy,
    recorded: list[Recorded],
    sessions: int,
    replan: bool,
) -> list[Any]:
    vocab = tokenizer.vocab_size
    registry = SessionRegistry()
    built = []
    for _ in range(sessions):
        session = registry.create()
        for rec in recorded:
            request = parse_chat_request(rec.body)
            if replan:
                plan = plan_turn(session, request, tokenizer, policy)
            else:
                plan = dataclasses.replace(rec.plan, messages=request.messages, tools=request.tools)
            answer = parse_worker_answer(
                rec.answer, sent_prompt_tokens=len(plan.input_ids), vocab_size=vocab
            )
            now = time.time()
            slot = session.claim(now)
            commit_turn(session, slot, plan, answer, rec.reply, now)
            session.release(slot, now)
        built.append(session)
    return built


async def main(args: argparse.Namespace) -> None:
    print(f"{load_average()}; {args.sessions} sessions x >= {args.tokens} tokens")
    tokenizer = load_tokenizer(tokenizer_path())
    async with child("emulator", emulator_command("--record-limit", "0")) as emulator:
        policy = TurnPolicy.of(Settings(workers=(emulator.url,)))
        recorded, proto = await prototype(
            emulator.url, tokenizer, policy, args.tokens, args.tool_result_words
        )
    per_session = len(proto.trajectory)
    print(f"prototype: {len(recorded)} turns, {per_session} tokens per session")
    del proto

    gc.collect()
    before = rss_bytes()
    started = time.perf_counter()
    sessions = build(tokenizer, policy, recorded, args.sessions, args.replan)
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
    parser.add_argument("--replan", action="store_true", help="plan_turn for every turn")
    parser.add_argument("--json", type=Path)
    trio.run(main, parser.parse_args())
