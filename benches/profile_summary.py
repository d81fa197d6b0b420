"""Summarise py-spy collapsed stacks (``py-spy record --format raw``).

Prints, as a share of all samples: the hottest leaf functions (self time), the
hottest functions including callees (inclusive time), and the same samples
attributed to the innermost frame inside ``--package`` (default
``rollout_session``): which of our functions the library time is spent for.
The large_turns/small_turns benchmarks write such files with ``--profile DIR``.

    python benches/profile_summary.py prof/p1-logprobs-replay-server.txt --top 25
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::(?P<line>\d+))?\)$")


def frames(stack: str) -> list[tuple[str, str]]:
    """(function, file) per frame, outermost first; line numbers dropped."""
    out = []
    for frame in stack.split(";"):
        match = _FRAME.match(frame.strip())
        out.append((match["func"], match["file"]) if match else (frame.strip(), ""))
    return out


def summarise(path: Path, package: str) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        stack_frames = frames(stack)
        names = [f"{file}:{func}" for func, file in stack_frames]
        own[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
        mine = [n for (func, file), n in zip(stack_frames, names, strict=True) if package in file]
        ours[mine[-1] if mine else "(outside the package: server, framework, idle loop)"] += count
    return total, own, inclusive, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("profile", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--package", default="rollout_session/")
    args = parser.parse_args()
    for path in args.profile:
        total, own, inclusive, ours = summarise(path, args.package)
        print(f"== {path} ({total} samples)")
        for title, counter in (
            ("self (leaf function)", own),
            ("inclusive", inclusive),
            (f"attributed to the innermost {args.package} frame", ours),
        ):
            print(f"-- {title}")
            for name, count in counter.most_common(args.top):
                print(f"{100 * count / max(total, 1):6.1f}%  {name}")
        print()


if __name__ == "__main__":
    main()
