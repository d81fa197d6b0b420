"""A rescore as the export shows it: aligned with the segment's tokens, and
its drift against the rollout's logprobs over the sampled positions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollout_session.export.rescores import drift, rescore_fields
from rollout_session.session.rescores import Rescore
from rollout_session.session.trajectory import Trajectory
from tests.unit.session.test_trajectory import commit


def test_drift_of_equal_logprobs_is_zero() -> None:
    figures = drift(np.zeros(5))
    assert figures == {"tokens": 5, "mean_abs": 0.0, "max_abs": 0.0, "approx_kl": 0.0}


def test_drift_of_nothing_is_none() -> None:
    assert drift(np.zeros(0))["approx_kl"] is None


def test_k3_estimates_the_kl_of_two_known_distributions() -> None:
    """Tokens drawn from p, r = log q − log p: mean(exp(r) − 1 − r) → KL(p‖q)."""
    rng = np.random.default_rng(0)
    p, q = np.array([0.7, 0.2, 0.1]), np.array([0.5, 0.3, 0.2])
    tokens = rng.choice(3, size=200_000, p=p)
    ratio = np.log(q[tokens]) - np.log(p[tokens])
    assert drift(ratio)["approx_kl"] == pytest.approx(float(np.sum(p * np.log(p / q))), rel=0.02)


def test_fields_align_with_the_tokens_and_compare_sampled_positions_only() -> None:
    traj = Trajectory()
    commit(traj, 0, [1, 2], [3, 4])  # sampled logprobs -0.1, -0.2 (test_trajectory.commit)
    commit(traj, 1, [5], [6])
    tokens = traj.tokens
    scored = np.full(4, np.nan, np.float32)  # scored before turn 1: 4 positions
    scored[2:] = [-0.1, -1.2]  # the first sampled token agrees, the second is 1.0 off
    fields = rescore_fields(
        Rescore(scored, "sampled", "pinned", "http://w", "m", "v", 0.0),
        tokens.logprobs,
        tokens.mask,
        traj.turns,
    )
    assert len(fields["logprobs"]) == len(traj) == 6 and fields["scored_tokens"] == 4
    assert np.isnan(fields["logprobs"][[0, 1, 4, 5]]).all()
    summary = fields["drift"]
    assert summary["tokens"] == 2
    assert (summary["mean_abs"], summary["max_abs"]) == pytest.approx((0.5, 1.0))
    assert summary["approx_kl"] == pytest.approx((math.expm1(-1.0) + 1.0) / 2)
    assert [t["tokens"] for t in summary["turns"]] == [2, 0]
