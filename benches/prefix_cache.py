"""First-turn prompt building with and without the shared-prefix cache.

In-process: `ChatTokenizer.first_turn` (render + tokenise) for first turns
that share a system prompt of ``--system-tokens`` (1k, 8k, 32k) tokens and a
tool list, each with its own short task, on the bundled tokenizer and the
built-in qwen3 template. The cache off and on alternate ``--repeats`` times;
reported per size: CPU ms per first turn (median over repeats, range), and
that the ids are equal both ways (the cache is only worth having if exact).

    python benches/prefix_cache.py
    python benches/prefix_cache.py --system-tokens 1000,8000,32000 --turns 200
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from _common import WORDS, bench_parser, table, write_json

from rollout_session.emulator.tokenizer import bundled_tokenizer_path
from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for name in ("read_file", "write_file", "run_tests", "search")
]


def _system(tok: ChatTokenizer, tokens: int) -> str:
    words: list[str] = []
    while len(tok.encode(" ".join(words))) < tokens:
        words.extend(WORDS[: max(1, (tokens - len(words)) // 2)])
    return " ".join(words)


def _run(tok: ChatTokenizer, system: str, turns: int, cached: bool) -> tuple[float, list[int]]:
    tok.prefixes.enabled = cached
    tok.prefixes._entries.clear()
    first: list[int] = []
    started = time.process_time()
    for i in range(turns):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Task {i}: fix the bug in module_{i}.py."},
        ]
        ids = tok.first_turn(messages, tools=TOOLS, kwargs={})
        if i == 0:
            first = ids
    return (time.process_time() - started) / turns * 1000, first


def main(sizes: list[int], turns: int, repeats: int) -> list[dict[str, Any]]:
    tok = load_tokenizer(bundled_tokenizer_path(), "qwen3")
    rows = []
    for size in sizes:
        system = _system(tok, size)
        off: list[float] = []
        on: list[float] = []
        for _ in range(repeats):
            ms_off, ids_off = _run(tok, system, turns, cached=False)
            ms_on, ids_on = _run(tok, system, turns, cached=True)
            assert ids_on == ids_off, "the cache changed a prompt's ids"
            off.append(ms_off)
            on.append(ms_on)
        rows.append(
            {
                "system tokens": len(tok.encode(system)),
                "prompt tokens": len(ids_on),
                "CPU ms/turn, cache off": round(statistics.median(off), 3),
                "range off": f"{min(off):.3f}–{max(off):.3f}",
                "CPU ms/turn, cache on": round(statistics.median(on), 3),
                "range on": f"{min(on):.3f}–{max(on):.3f}",
                "on / off": round(statistics.median(on) / statistics.median(off), 3),
                "ids equal": True,
            }
        )
        print(table(rows[-1:]), flush=True)
    print(table(rows))
    return rows


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--system-tokens", default="1000,8000,32000")
    parser.add_argument("--turns", type=int, default=100, help="first turns per run")
    parser.add_argument("--repeats", type=int, default=5, help="off/on alternations")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.system_tokens.split(",")]
    write_json(args.json, main(sizes, args.turns, args.repeats))
