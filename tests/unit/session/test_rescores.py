"""Rescores are cut with the tokens they scored: after a rollback a rescore
covers only positions whose tokens are still the segment's."""

from __future__ import annotations

import numpy as np

from rollout_session.session.rescores import Rescore
from rollout_session.session.trajectory import Trajectory
from tests.unit.session.test_trajectory import commit


def rescore(length: int) -> Rescore:
    values = -np.arange(length, dtype=np.float32) - 0.5
    values[0] = np.nan
    return Rescore(values, "all", "teacher", "http://w", "m", "v", 0.0)


def test_a_rollback_cuts_the_rescore_to_the_kept_tokens() -> None:
    traj = Trajectory()
    commit(traj, 0, [1, 2], [3, 4])
    commit(traj, 1, [5], [6, 7])
    traj.rescores["t"] = rescore(len(traj))  # 7 positions
    commit(traj, 1, [5], [9])  # a retry of turn 1: tokens from 4 on are new
    assert len(traj.rescores["t"].logprobs) == 4
    assert traj.rescores["t"].logprobs[1:].tolist() == [-1.5, -2.5, -3.5]


def test_a_turn_that_extends_the_segment_keeps_the_rescore_whole() -> None:
    traj = Trajectory()
    commit(traj, 0, [1, 2], [3, 4])
    traj.rescores["t"] = rescore(len(traj))
    commit(traj, 1, [5], [6])
    assert len(traj.rescores["t"].logprobs) == 4  # covers what it scored; the rest is unscored


def test_undo_keeps_the_cut() -> None:
    """An undone rollback puts the tokens back, not the cut positions'
    logprobs: fewer positions, never wrong ones."""
    traj = Trajectory()
    commit(traj, 0, [1, 2], [3, 4])
    commit(traj, 1, [5], [6, 7])
    traj.rescores["t"] = rescore(len(traj))
    checkpoint = traj.checkpoint(1)
    commit(traj, 1, [5], [9])
    traj.undo(checkpoint)
    assert len(traj) == 7 and len(traj.rescores["t"].logprobs) == 4
