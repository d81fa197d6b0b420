"""`trainers.agent`: an agent named ``module:function``."""

from __future__ import annotations

import pytest

from rollout_session.trainers import load_agent
from rollout_session.trainers.example_agent import solve


def test_an_agent_by_name_and_as_itself() -> None:
    assert load_agent("rollout_session.trainers.example_agent:solve") is solve
    assert load_agent(solve) is solve


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("rollout_session.trainers.example_agent", ValueError, "package.module:function"),
        (":solve", ValueError, "package.module:function"),
        ("no_such_module_here:solve", ValueError, "cannot import"),
        ("rollout_session.trainers.example_agent:missing", ValueError, "has no 'missing'"),
        ("rollout_session.trainers.example_agent:MAX_TURNS", TypeError, "not a function"),
    ],
    ids=["no-function", "no-module", "unimportable", "missing", "not-callable"],
)
def test_a_bad_agent_name_says_why(spec: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_agent(spec)
