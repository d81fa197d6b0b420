"""Delta-sync's bookkeeping: what a turn sends, and when it rebuilds."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_session.engines.sglang_generate.delta import (
    Rebuild,
    RemoteSessions,
    dp_rank,
    lost_session,
)

W, V = "http://w:1", "http://v:2"


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def test_a_turn_after_a_finished_one_sends_only_the_new_ids() -> None:
    remote = RemoteSessions()
    first = remote.plan("s", W, ids(1, 2, 3))
    assert first.rebuild is Rebuild.FIRST and first.session_params == {"id": first.remote_id}
    remote.finished("s", W, first, "r1", ids(1, 2, 3), ids(4, 5))
    second = remote.plan("s", W, ids(1, 2, 3, 4, 5, 6, 7))
    assert second.rebuild is None and second.input_ids.tolist() == [6, 7]
    assert second.session_params == {"id": first.remote_id, "rid": "r1"}
    remote.finished("s", W, second, "r2", ids(1, 2, 3, 4, 5, 6, 7), ids(8))
    assert remote.delta_turns == 1 and remote.rebuilds == {"first": 1}


@pytest.mark.parametrize(
    ("worker", "prompt", "cause"),
    [
        (V, ids(1, 2, 3, 4, 5, 6), Rebuild.MOVED),
        (W, ids(1, 2, 9, 4, 5, 6), Rebuild.BRANCHED),  # an id the worker holds differs
        (W, ids(1, 2, 3, 4, 5), Rebuild.BRANCHED),  # nothing new: SGLang refuses that
        (W, ids(1, 2), Rebuild.BRANCHED),  # shorter: a rollback
    ],
    ids=["moved", "changed", "nothing-new", "shorter"],
)
def test_what_the_worker_holds_not_prefixing_the_prompt_rebuilds(
    worker: str, prompt: np.ndarray, cause: Rebuild
) -> None:
    remote = RemoteSessions()
    first = remote.plan("s", W, ids(1, 2, 3))
    remote.finished("s", W, first, "r1", ids(1, 2, 3), ids(4, 5))
    plan = remote.plan("s", worker, prompt)
    assert plan.rebuild is cause and plan.input_ids.tolist() == prompt.tolist()
    assert plan.remote_id != first.remote_id and "rid" not in plan.session_params
    assert remote.rebuilds[cause.value] == 1


def test_a_dropped_state_rebuilds_and_says_why() -> None:
    remote = RemoteSessions()
    first = remote.plan("s", W, ids(1))
    remote.finished("s", W, first, "r1", ids(1), ids(2))
    assert remote.drop("s") is not None
    assert remote.plan("s", W, ids(1, 2, 3)).rebuild is Rebuild.DROPPED
    assert remote.forget("s") is None and remote.plan("s", W, ids(1)).rebuild is Rebuild.FIRST


@pytest.mark.parametrize(
    ("message", "lost"),
    [
        ("Invalid request: session id abc does not exist", True),
        ("Invalid request session id", True),
        ("Invalid request: close was requested for session abc", True),
        ("The input (9 tokens) is longer than the model's context length (8 tokens).", False),
    ],
    ids=["unknown-session", "unknown-rid", "closing", "too-long"],
)
def test_sglangs_lost_session_messages_are_recognised(message: str, lost: bool) -> None:
    assert lost_session(message) is lost


def test_a_session_keeps_one_dp_rank() -> None:
    assert dp_rank("s", 1) is None
    ranks = {dp_rank(f"s{i}", 4) for i in range(64)}
    assert ranks == {0, 1, 2, 3} and dp_rank("abc", 4) == dp_rank("abc", 4)
