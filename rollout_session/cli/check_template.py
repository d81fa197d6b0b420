"""``rollout-session check-template``: whether ``serve`` would start with a
tokenizer's chat template, case by case (`prompt.check`). Its flags cost
nothing to add; the tokenizer stack is imported when the check runs.
"""

from __future__ import annotations

import argparse

from ..config import Settings
from .options import _csv, _json_object

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``check-template`` flags to `parser`."""
    defaults = Settings(demo=True)
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer (model) directory")
    parser.add_argument(
        "--chat-template",
        help="template file, built-in (chatml, qwen3), or the name of one of the tokenizer's "
        "templates (tool_use); default: the tokenizer's own, each named one checked",
    )
    parser.add_argument("--chat-template-kwargs", type=_json_object, default={}, help="JSON object")
    parser.add_argument(
        "--append-roles",
        type=_csv,
        default=defaults.append_roles,
        help="roles agents may append (decides which cases `serve` would refuse)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the conformance report; 0 if `serve` would start, else 1."""
    from ..prompt.check import check_template, format_report, rendered_whole, startup_refusal
    from ..prompt.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, args.chat_template)
    results = check_template(tokenizer, args.chat_template_kwargs)
    print(format_report(results))
    for line in rendered_whole(results).values():
        # What `serve` logs at start-up: how it serves such a template, at what cost.
        print(f"\n{line}.")
    refusal = startup_refusal(results, args.append_roles)
    if refusal is not None:
        # The same message `serve` refuses with: its first line names the fix.
        print(f"\nserve would refuse to start: {refusal}")
        return 1
    print("\nserve would start with this template.")
    return 0
