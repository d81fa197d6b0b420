"""Compact token storage, commits, rollback and invariant checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rollout_session.session import trajectory
from rollout_session.session.trajectory import TokenBuffer, Trajectory, Turn
from rollout_session.tokens import VersionSpan


def make_turn(index: int, start: int, prompt: int, sampled: int, messages_end: int) -> Turn:
    return Turn(
        index,
        start,
        start + prompt,
        start + prompt + sampled,
        messages_end,
        "stop",
        "http://w",
        None,
        0,
        0.1,
        0.0,
    )


def commit(traj: Trajectory, keep: int, prompt: list[int], sampled: list[int]) -> None:
    start = traj.length_after(keep)
    traj.commit(
        keep_turns=keep,
        prompt_ids=prompt,
        sampled_ids=np.array(sampled, np.int32),
        sampled_logprobs=(-np.arange(1, len(sampled) + 1) / 10).astype(np.float32),
        turn=make_turn(keep, start, len(prompt), len(sampled), 2 * (keep + 1)),
    )


def test_commit_appends_masks_and_logprobs() -> None:
    traj = Trajectory()
    commit(traj, 0, [1, 2, 3], [4, 5])
    commit(traj, 1, [6], [7])
    assert traj.tokens.ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert traj.tokens.mask.tolist() == [0, 0, 0, 1, 1, 0, 1]
    assert np.allclose(traj.tokens.logprobs, [0, 0, 0, -0.1, -0.2, 0, -0.1])
    assert traj.sampled_ids(1).tolist() == [7]
    assert traj.check() is None


def test_rollback_truncates_then_appends() -> None:
    traj = Trajectory()
    commit(traj, 0, [1], [2])
    commit(traj, 1, [3], [4, 5])
    commit(traj, 1, [9], [8])  # retry of turn 1
    assert traj.tokens.ids.tolist() == [1, 2, 9, 8]
    assert [t.index for t in traj.turns] == [0, 1]
    assert traj.check() is None


def test_check_reports_corruption() -> None:
    traj = Trajectory()
    commit(traj, 0, [1], [2])
    traj.tokens.truncate(1)
    assert traj.check() is not None


def test_storage_stays_under_16_bytes_per_token() -> None:
    buffer = TokenBuffer()
    for _ in range(400):  # many small appends, as turns do
        buffer.append(list(range(7)))
        buffer.append((), np.arange(13, dtype=np.int32), np.zeros(13, np.float32))
    assert len(buffer) == 8000
    assert buffer.nbytes / len(buffer) <= 16


def test_storage_is_ids_plus_sampled_logprobs_without_slack() -> None:
    traj = Trajectory()
    commit(traj, 0, list(range(100)), list(range(10)))
    commit(traj, 1, list(range(50)), list(range(5)))
    tokens = traj.tokens
    # 4 bytes per id, 4 per sampled logprob, two int32 bounds per commit.
    assert tokens.nbytes == 4 * 165 + 4 * 15 + 2 * 2 * 4
    assert tokens.num_sampled == 15
    assert tokens.runs() == [(100, 110), (160, 165)]


def test_turn_views_need_no_whole_sequence() -> None:
    traj = Trajectory()
    commit(traj, 0, [1, 2], [3, 4])
    commit(traj, 1, [5], [6, 7, 8])
    assert traj.sampled_ids(1).tolist() == [6, 7, 8]
    assert np.allclose(traj.sampled_logprobs(1), [-0.1, -0.2, -0.3])
    assert traj.tokens.ids_between(4, 5).tolist() == [5]
    assert traj.tokens.prefix_ids(4, [9]).tolist() == [1, 2, 3, 4, 9]
    assert traj.tokens.prefix_ids(3).tolist() == [1, 2, 3]


def test_truncate_inside_a_chunk_keeps_its_head() -> None:
    buffer = TokenBuffer()
    buffer.append([1, 2, 3], np.array([4, 5, 6], np.int32), np.array([-1, -2, -3], np.float32))
    buffer.truncate(5)
    assert buffer.ids.tolist() == [1, 2, 3, 4, 5]
    assert buffer.mask.tolist() == [0, 0, 0, 1, 1]
    assert buffer.logprobs.tolist() == [0, 0, 0, -1, -2]
    assert buffer.num_sampled == 2
    buffer.truncate(2)
    assert buffer.ids.tolist() == [1, 2]
    assert buffer.runs() == []
    assert buffer.num_sampled == 0


def test_check_reports_sampled_runs_that_are_not_the_turns() -> None:
    traj = Trajectory()
    commit(traj, 0, [1], [2])
    traj.tokens.append((), np.array([3], np.int32), np.zeros(1, np.float32))
    traj.tokens.truncate(2)
    assert traj.check() is None
    traj.tokens.truncate(1)
    traj.tokens.append([2])  # same length, but the sampled token is gone
    assert traj.check() is not None


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"seed-{s}")
def test_ranges_within_one_chunk_are_found_by_bisection(seed: int) -> None:
    """`ids_between` and `sampled_logprobs` find a turn's chunk in O(log n):
    same answer as a scan, with prompt-less and sample-less chunks."""
    rng = np.random.default_rng(seed)
    buffer = TokenBuffer()
    for _ in range(30):
        prompt, sampled = (int(x) for x in rng.integers(0, 4, 2))
        ids = rng.integers(0, 1000, sampled).astype(np.int32)
        buffer.append(
            list(rng.integers(0, 1000, prompt)), ids, -rng.random(sampled).astype(np.float32)
        )
    spans = buffer._spans()
    n = len(buffer)
    for start in range(n + 1):
        for end in range(start, n + 1):
            scanned = next(
                ((k, s, m, e) for k, (s, m, e) in enumerate(spans) if s <= start and end <= e),
                None,
            )
            assert buffer._within_chunk(start, end) == scanned, (start, end)
    assert np.array_equal(buffer.ids_between(0, n), buffer.ids)


def _commit_versioned(traj: Trajectory, keep: int) -> None:
    """A turn of 2 prompt and 3 sampled tokens, its sampled tokens labelled."""
    start = traj.length_after(keep)
    traj.commit(
        keep_turns=keep,
        prompt_ids=[1, 2],
        sampled_ids=np.array([3, 4, 5], np.int32),
        sampled_logprobs=np.zeros(3, np.float32),
        turn=dataclasses.replace(
            make_turn(keep, start, 2, 3, 2 * (keep + 1)),
            weight_versions=(VersionSpan(0, 3, "v1"),),
        ),
    )


def _checked(turns: int) -> Trajectory:
    """A trajectory of `turns` turns that passed its check after each commit."""
    traj = Trajectory()
    for i in range(turns):
        _commit_versioned(traj, i)
        assert traj.check() is None
    return traj


def test_a_check_after_one_more_turn_checks_that_turn_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the last passing check verified is not checked again: the work
    grows with the new turns, not with the history."""
    traj = _checked(50)
    checked: list[int] = []
    real_tiles = trajectory.tiles

    def counting_tiles(spans: tuple[VersionSpan, ...], n: int) -> bool:
        checked.append(n)
        return real_tiles(spans, n)

    monkeypatch.setattr(trajectory, "tiles", counting_tiles)
    _commit_versioned(traj, 50)
    assert traj.check() is None
    assert len(checked) == 1  # the new turn's spans, none of the 50 before
    traj.turns[10] = dataclasses.replace(traj.turns[10])  # equal, not the same object
    assert traj.check() is None
    assert len(checked) == 1
    commit(traj, 20, [1], [2])  # a rollback (rare): checked whole again
    assert traj.check() is None
    assert len(checked) == 1 + 20


@pytest.mark.parametrize(
    "corrupt",
    ["earlier-chunks-rewritten", "earlier-turn-replaced", "turn-dropped", "last-chunk-rewritten"],
)
def test_a_change_to_what_was_verified_is_still_found(corrupt: str) -> None:
    """Changed turns or chunks before the last check's mark are checked
    again, whole: nothing verified once is trusted after it changed."""
    traj = _checked(4)
    tokens = traj.tokens
    if corrupt == "earlier-chunks-rewritten":
        # The same length and sampled count: turns 1 and 2's runs moved.
        tokens.truncate(5)
        tokens.append([1, 2, 3], np.array([4, 5], np.int32), np.zeros(2, np.float32))
        tokens.append([1], np.array([2, 3, 4, 5], np.int32), np.zeros(4, np.float32))
        tokens.append([1, 2], np.array([3, 4, 5], np.int32), np.zeros(3, np.float32))
        assert (len(tokens), tokens.num_sampled) == (20, 12)
    elif corrupt == "earlier-turn-replaced":
        traj.turns[1] = dataclasses.replace(traj.turns[1], index=7)
    elif corrupt == "turn-dropped":
        del traj.turns[2]
    else:
        tokens.truncate(15)
        tokens.append([1, 2, 3], np.array([4, 5], np.int32), np.zeros(2, np.float32))
    assert traj.check() is not None


def test_a_rollback_is_checked_from_its_kept_turns() -> None:
    traj = _checked(6)
    commit(traj, 3, [9], [8, 7])
    assert traj.check() is None
    assert [t.index for t in traj.turns] == [0, 1, 2, 3]
    traj.tokens.truncate(len(traj.tokens) - 1)  # the new turn's last token lost
    assert traj.check() is not None
