"""P3 TITO cost vs history: prompt-building time per turn over a long tool conversation.

One agent runs ``--turns`` (128) tool turns against a real emulator process:
every answer is a tool call (``tool_choice: "required"``), every next request
appends a ~``--tool-result-words`` tool result, so the history reaches tens of
thousands of tokens. Each turn is the server's own: `TurnRunner.run` in this
process (claim, `parse_chat_request`, `plan_turn`, the ``sglang-chat`` engine
with a worker pool of the emulator: `chat_body`, the worker call over HTTP,
`check_answer`; commit), as the server builds it minus the HTTP edge
(benches/_turns.py). Before each turn, the prompt-building steps are timed
on their own (median of ``--repeats`` calls; they do not mutate the session),
together with the baseline that token-in/token-out avoids: re-rendering and
re-tokenising the whole conversation (`ChatTokenizer.first_turn` over all
messages); the worker body (`chat_body`) is timed after the turn, on the
very request the runner handed the engine.

Measured in-process rather than over HTTP because the quantity is a few
milliseconds of CPU that loopback, the emulator and the event loop would
bury; the session is still built by real turns with real worker answers. At
the end, the committed ids are checked against the full rendering of the last
request (the TITO invariant), so the benchmark measures the real thing.

``--render-whole`` serves the template as the server serves one whose
appended messages depend on the history
(docs/templates.md#history-dependent-templates): each turn first renders
the whole conversation to ask whether the template appends as the junction
does. The template here does, so ``plan ms`` is the least that mode costs
(one render of the whole conversation per turn, not tokenised), against the
token-in/token-out ``plan ms`` of a run without it on the same
conversation; a turn that it does not append alike also tokenises that
render (about ``full re-render ms``).

    python benches/tito_cost.py                  # 128 turns
    python benches/tito_cost.py --turns 32 --plot docs/img/p3.png
    python benches/tito_cost.py --render-whole   # the mode of history-dependent templates
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import trio
from _common import (
    WORDS,
    after_tool_call,
    bench_parser,
    child,
    emulator_command,
    load_average,
    ms,
    pyplot,
    save_figure,
    table,
    tokenizer_path,
    write_json,
)
from _turns import Recorder, emulator_runner

from rollout_session.engines.sglang_chat.engine import chat_body
from rollout_session.prompt.messages import common_prefix
from rollout_session.prompt.tokenizer import load_tokenizer
from rollout_session.turn.plan import plan_turn
from rollout_session.turn.request import parse_chat_request

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_command",
            "description": "Run a shell command in the sandbox and return its output",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "cwd": {"type": "string"},
                    "timeout_s": {"type": "integer"},
                },
                "required": ["command"],
            },
        },
    }
]


def tool_result(turn: int, words: int) -> str:
    lines = []
    for line in range(max(1, words // 8)):
        picks = (WORDS[(turn * 13 + line * 5 + i) % len(WORDS)] for i in range(7))
        lines.append(f"{line}: " + " ".join(picks))
    return "\n".join(lines)


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def main(args: argparse.Namespace) -> None:
    mode = "rendered whole" if args.render_whole else "token-in/token-out"
    print(
        f"{load_average()}; {args.turns} tool turns, median of {args.repeats} per step; "
        f"prompts {mode}"
    )
    emulator_flags = ["--context-length", str(args.context_length), "--record-limit", "0"]
    if args.chat_template:
        emulator_flags += ["--chat-template", args.chat_template]
    tokenizer = load_tokenizer(tokenizer_path(), args.chat_template)
    async with (
        child("emulator", emulator_command(*emulator_flags)) as emulator,
        emulator_runner(emulator.url, tokenizer) as served,
    ):
        runner = served
        if args.render_whole:  # as start-up serves a history-dependent template
            whole = frozenset(t.name for t in tokenizer.templates)
            policy = dataclasses.replace(served.policy, rendered_whole=whole)
            runner = dataclasses.replace(served, policy=policy)
        recorder = runner.engine
        assert isinstance(recorder, Recorder)
        policy = runner.policy
        session = await runner.store.create(None, metadata=None, ttl_s=None)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful coding agent. " * 20},
            {"role": "user", "content": "Find out why the build fails and fix it."},
        ]
        rows: list[dict[str, Any]] = []
        for turn in range(1, args.turns + 1):
            body = orjson.dumps(
                {
                    "messages": messages,
                    "tools": TOOLS,
                    "tool_choice": "required",
                    "max_tokens": 512,
                    "seed": turn,
                }
            )
            request = parse_chat_request(body)
            plan = plan_turn(session, request, tokenizer, policy)
            history = len(session.trajectory)
            row: dict[str, Any] = {
                "turn": turn,
                "history tokens": history,
                "messages": len(request.messages),
                "new tokens": len(plan.prompt_ids),
                "body KiB": len(body) / 1024,
            }
            row["parse ms"] = ms(median_time(partial(parse_chat_request, body), args.repeats))
            row["plan ms"] = ms(
                median_time(
                    partial(plan_turn, session, request, tokenizer, policy),
                    args.repeats,
                )
            )
            if turn > 1:
                end = session.trajectory.turns[-1].messages_end
                previous = session.conversation.message(end - 1)
                new = request.messages[end:]
                row["render new ms"] = ms(
                    median_time(
                        partial(tokenizer.junction, previous, new, tools=request.tools, kwargs={}),
                        args.repeats,
                    )
                )
                row["match history ms"] = ms(
                    median_time(
                        partial(common_prefix, session.messages, request.messages),
                        args.repeats,
                    )
                )
            row["full re-render ms"] = ms(
                median_time(
                    partial(tokenizer.first_turn, request.messages, tools=request.tools, kwargs={}),
                    max(1, args.repeats // 2),
                )
            )
            # The real turn: the runner (plan, worker call, validation, commit).
            outcome = await runner.run(session.id, body)
            if outcome.reply.status != 200:
                raise SystemExit(
                    f"turn {turn}: worker said {outcome.reply.status}: {outcome.reply.body[:300]!r}"
                )
            # The worker's body, built from the request the runner handed the engine.
            sent, _ = recorder.completion()
            assert np.array_equal(sent.input_ids, plan.input_ids), "the runner planned otherwise"
            model = runner.model.upstream_name(request.raw.get("model"))
            row["upstream body ms"] = ms(
                median_time(
                    partial(chat_body, sent, model, session_hint=None, rid="bench"), args.repeats
                )
            )
            row["TITO total ms"] = row["parse ms"] + row["plan ms"] + row["upstream body ms"]
            rows.append(row)
            messages = after_tool_call(
                messages, outcome.reply.body, tool_result(turn, args.tool_result_words)
            )
            if turn in args.show or turn == args.turns:
                print(table([row], _COLUMNS), flush=True)
        # The TITO invariant over the whole conversation: stored ids == full render.
        last = session.trajectory.turns[-1]
        stored = session.trajectory.tokens.ids[: last.completion_start]
        full = tokenizer.first_turn(request.messages, tools=TOOLS, kwargs={})
        same = np.array_equal(stored, np.asarray(full, np.int32))
    shown = [r for r in rows if r["turn"] in args.show or r["turn"] == args.turns]
    print()
    print(load_average())
    print(table(shown, _COLUMNS))
    print(f"TITO ids == full re-render of the last request ({len(full)} tokens): {same}")
    by_turn = {r["turn"]: r for r in rows}
    if 2 in by_turn and args.turns >= 2:
        last_row, second = by_turn[args.turns], by_turn[2]
        for key in ("plan ms", "TITO total ms", "full re-render ms"):
            print(
                f"{key}: turn {args.turns} / turn 2 = {last_row[key]:.2f} / {second[key]:.2f} "
                f"= {last_row[key] / second[key]:.2f}x"
            )
        if not args.render_whole:
            print("target: plan ms turn 128 <= 1.5x turn 2; TITO total turn 128 <= 1.8x turn 2")
    write_json(
        args.json,
        {
            "args": {k: str(v) for k, v in vars(args).items()},
            "load": load_average(),
            "tito_equals_full_render": bool(same),
            "rows": rows,
        },
    )
    if args.plot:
        plot(rows, args.plot)


_COLUMNS = [
    "turn",
    "history tokens",
    "messages",
    "new tokens",
    "body KiB",
    "parse ms",
    "match history ms",
    "render new ms",
    "plan ms",
    "upstream body ms",
    "TITO total ms",
    "full re-render ms",
]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    xs = [r["turn"] for r in rows]
    for key, style in (
        ("full re-render ms", "-"),
        ("TITO total ms", "-"),
        ("plan ms", "-"),
        ("parse ms", "--"),
        ("render new ms", ":"),
    ):
        ax.plot(xs, [r.get(key, float("nan")) for r in rows], style, label=key.replace(" ms", ""))
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("ms per turn (median)")
    top = rows[-1]["history tokens"] if rows else 0
    ax.set_title(f"P3: prompt building vs history (tool conversation, {top:,} tokens at the end)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--turns", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per step (median)")
    parser.add_argument("--tool-result-words", type=int, default=240)
    parser.add_argument("--context-length", type=int, default=131072)
    parser.add_argument("--chat-template", help="built-in name or file (default: tokenizer's)")
    parser.add_argument(
        "--show",
        type=lambda s: {int(x) for x in s.split(",")},
        default={1, 2, 4, 8, 16, 32, 64, 96, 128},
        help="turns printed in the table",
    )
    parser.add_argument(
        "--render-whole",
        action="store_true",
        help="serve the template as one whose appended messages depend on the history "
        "(each turn renders the whole conversation)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    trio.run(main, parser.parse_args())
