"""`Trajectory.checkpoint` / `undo`: a commit the journal could not make
durable is taken back exactly, whatever it replaced."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollout_session.session.trajectory import Trajectory, Turn


def commit(
    trajectory: Trajectory,
    rng: np.random.Generator,
    *,
    keep: int | None = None,
    prompt: int = 5,
    sampled: int = 7,
    width: int | None = None,
) -> None:
    keep = len(trajectory.turns) if keep is None else keep
    start = trajectory.length_after(keep)
    turn = Turn(
        index=keep,
        prompt_start=start,
        completion_start=start + prompt,
        completion_end=start + prompt + sampled,
        messages_end=2 * keep + 2,
        finish_reason="stop",
        worker="http://w",
        weight_version=None,
        cached_tokens=None,
        upstream_latency_s=0.0,
        created_at=0.0,
    )
    experts = None
    if width is not None:
        positions = turn.completion_end - 1 - trajectory.expert_positions(keep)
        experts = rng.integers(0, 64, positions * width, dtype=np.int32).tobytes()
    trajectory.commit(
        keep_turns=keep,
        prompt_ids=rng.integers(0, 1000, prompt).tolist(),
        sampled_ids=rng.integers(0, 1000, sampled, dtype=np.int32),
        sampled_logprobs=(-rng.exponential(1.0, sampled)).astype(np.float32),
        turn=turn,
        experts=experts,
        experts_width=width,
    )


def state(trajectory: Trajectory) -> dict[str, Any]:
    tokens = trajectory.tokens
    return {
        "ids": tokens.ids.tobytes(),
        "logprobs": tokens.logprobs.tobytes(),
        "mask": tokens.mask.tobytes(),
        "runs": tokens.runs(),
        "sampled": tokens.num_sampled,
        "turns": list(trajectory.turns),
        "experts": (bytes(trajectory.experts), trajectory.experts_width),
    }


# (turns kept by the commit undone, its sampled tokens, routed experts width)
CASES = {
    "append": (None, 7, None),
    "empty-completion": (None, 0, None),
    "rollback": (1, 7, None),
    "first-turn-retry": (0, 7, None),
    "append-with-experts": (None, 7, 3),
    "rollback-with-experts": (1, 7, 3),
}


@pytest.mark.parametrize(("keep", "sampled", "width"), CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("history", [0, 3], ids=["fresh", "three-turns"])
def test_undo_puts_back_what_the_commit_replaced(
    keep: int | None, sampled: int, width: int | None, history: int
) -> None:
    rng = np.random.default_rng(history)
    trajectory = Trajectory()
    for _ in range(history):
        commit(trajectory, rng, width=width)
    keep = None if keep is None else min(keep, history)
    before = state(trajectory)
    checkpoint = trajectory.checkpoint(len(trajectory.turns) if keep is None else keep)
    commit(trajectory, rng, keep=keep, sampled=sampled, width=width)
    assert state(trajectory) != before
    trajectory.undo(checkpoint)
    assert state(trajectory) == before
    assert trajectory.check() is None
    # And it takes the next turn as if nothing had happened.
    commit(trajectory, rng, width=width)
    assert trajectory.check() is None


def test_a_checkpoint_without_rollback_copies_nothing() -> None:
    rng = np.random.default_rng(0)
    trajectory = Trajectory()
    for _ in range(3):
        commit(trajectory, rng, width=2)
    checkpoint = trajectory.checkpoint(3)
    assert checkpoint.dropped == [] and checkpoint.experts_tail == b""
