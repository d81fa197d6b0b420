"""An episode's export as SkyRL's rows, and a batch of them as its
``GeneratorOutput`` (rollout_session/trainers/skyrl/outputs.py); SkyRL's
own checks of the output run in tests/trainers/skyrl."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollout_session.trainers import EpisodeFailed
from rollout_session.trainers.skyrl.outputs import (
    EpisodeRows,
    generator_output,
    placeholder_row,
    step_rows,
    stop_reason,
    trajectory_row,
)
from tests.unit.trainers.export_docs import episode, segment

SYSTEM = [1, 2, 3]
TOOL = [7, 8]


def _two_turns(index: int = 0, **kwargs: Any) -> dict[str, Any]:
    return segment(
        index,
        [
            (SYSTEM, [10, 11, 12], "tool_calls", [(3, "1")], 0),
            (TOOL, [13, 14], "stop", [(1, "1"), (1, "2")], 1),
        ],
        **kwargs,
    )


def test_one_segment_is_one_row_exactly() -> None:
    row = trajectory_row(episode(_two_turns(), reward=0.25), None)
    assert row.prompt_ids == SYSTEM
    assert row.response_ids == [10, 11, 12, *TOOL, 13, 14]
    assert row.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert row.logprobs == [-0.5, -0.51, -0.52, 0.0, 0.0, -0.5, -0.51]
    assert row.versions == ["1", "1", "1", None, None, "1", "2"]
    assert (row.reward, row.stop_reason, row.routes) == (0.25, "stop", None)


def test_a_rewritten_history_has_no_single_row() -> None:
    rewritten = episode(
        _two_turns(), segment(1, [([4], [20, 21], "stop", [(2, "2")], 0)], branch="history_edited")
    )
    with pytest.raises(
        EpisodeFailed, match=r"2 segments sampled: history_edited.*step_wise_trajectories=true"
    ):
        trajectory_row(rewritten, None)


def test_a_segment_that_sampled_nothing_is_not_a_segment_of_the_row() -> None:
    # A segment whose only turn sampled nothing (a render the agent then
    # rewrote) holds nothing to train on: the other one is the row.
    empty = segment(0, [(SYSTEM, [], "abort", [], 0)])
    row = trajectory_row(episode(empty, _two_turns(1, branch="history_edited")), None)
    assert row.response_ids[:3] == [10, 11, 12]


def test_an_episode_without_a_sampled_token_or_a_reward_is_refused() -> None:
    with pytest.raises(EpisodeFailed, match="sampled no token"):
        trajectory_row(episode(segment(0, [(SYSTEM, [], "abort", [], 0)])), None)
    with pytest.raises(EpisodeFailed, match="sampled no token"):
        step_rows(episode(segment(0, [(SYSTEM, [], "abort", [], 0)])), None)
    with pytest.raises(EpisodeFailed, match="returned no reward"):
        trajectory_row(episode(_two_turns(), reward=None), None)
    with pytest.raises(EpisodeFailed, match="returned no reward"):
        step_rows(episode(_two_turns(), reward=None), None)


def test_step_rows_are_every_turn_of_every_segment() -> None:
    second = segment(1, [([4, 5], [20, 21], "length", [(2, "3")], 0)], branch="answer_dropped")
    rows = step_rows(episode(_two_turns(), second, reward=2.0), None)
    assert [(r.prompt_ids, r.response_ids) for r in rows] == [
        (SYSTEM, [10, 11, 12]),
        ([*SYSTEM, 10, 11, 12, *TOOL], [13, 14]),
        ([4, 5], [20, 21]),
    ]
    assert [r.loss_mask for r in rows] == [[1, 1, 1], [1, 1], [1, 1]]
    assert [r.logprobs for r in rows] == [[-0.5, -0.51, -0.52], [-0.5, -0.51], [-0.5, -0.51]]
    assert [r.versions for r in rows] == [["1", "1", "1"], ["1", "2"], ["3", "3"]]
    assert [r.reward for r in rows] == [0.0, 0.0, 2.0]
    assert [r.stop_reason for r in rows] == ["stop", "stop", "length"]


def test_a_turn_that_sampled_nothing_is_no_step() -> None:
    doc = segment(0, [(SYSTEM, [10], "stop", [(1, "1")], 0), ([4], [], "abort", [], 0)])
    rows = step_rows(episode(doc, reward=1.0), None)
    assert [(r.response_ids, r.reward) for r in rows] == [([10], 1.0)]


def _full_routes(doc: dict[str, Any], layers: int, top_k: int) -> np.ndarray:
    positions = len(doc["token_ids"]) - 1
    return np.fromfunction(
        lambda p, layer, k: (p * 7 + layer * 3 + k) % 64, (positions, layers, top_k), dtype=np.int32
    )


def test_routed_experts_in_skyrls_layout() -> None:
    doc = _two_turns(routes=(4, 2))
    full = _full_routes(doc, 4, 2)
    row = trajectory_row(episode(doc), 2)
    assert row.routes is not None and row.routes.tolist() == full.tolist()
    first, second = step_rows(episode(doc), 2)
    # A step's routes: every position of its prompt and response that was
    # forwarded (its last sampled token only if a later turn read it).
    assert first.routes is not None and first.routes.tolist() == full[:6].tolist()
    assert second.routes is not None and second.routes.tolist() == full.tolist()
    with pytest.raises(ValueError, match="--routed-experts"):
        trajectory_row(episode(_two_turns()), 2)


def test_stop_reasons() -> None:
    assert [stop_reason(r) for r in ("stop", "tool_calls", "length", "abort", None)] == [
        "stop",
        "stop",
        "length",
        "abort",
        "error",
    ]
    assert stop_reason("content_filter") == "content_filter"


def _compact(routes: np.ndarray) -> np.ndarray:
    return routes.astype(np.uint8)


def test_a_batch_of_step_rows() -> None:
    doc = _two_turns(routes=(4, 2))
    trained = EpisodeRows(
        step_rows(episode(doc), 2), "s1", 1.5, segments=1, turns=2, continuations=1
    )
    masked = EpisodeRows([placeholder_row(0)], None, 0.5, masked="the agent failed")
    out = generator_output(
        [trained, masked], ["a", "b"], step_wise=True, logprobs=True, routes=True, compact=_compact
    )
    assert out["trajectory_ids"] == ["a", "a", "b"]
    assert out["is_last_step"] == [False, True, True]
    assert out["rewards"] == [0.0, 1.0, 0.0]
    assert out["loss_masks"][2] == [0]
    assert out["stop_reasons"] == ["stop", "stop", "error"]
    assert out["trajectory_generation_times"] == [1.5, 1.5, 0.5]
    routes = out["rollout_expert_indices"]
    assert [r.dtype for r in routes] == [np.uint8] * 3
    # The placeholder's: one row of zeros, the batch's [layers, top_k].
    assert routes[2].shape == (1, 4, 2) and not routes[2].any()
    assert out["env_metrics"][2] == {"session_id": None, "masked": "the agent failed"}
    assert out["rollout_metrics"] == {
        "rollout_session/episodes": 2,
        "rollout_session/masked_episodes": 1,
        "rollout_session/segments_per_episode": 1.0,
        "rollout_session/turns_per_episode": 2.0,
        "rollout_session/continuations": 1,
        "rollout_session/min_weight_version": 1,
        "rollout_session/max_weight_version": 2,
    }


def test_a_batch_of_trajectory_rows() -> None:
    rows = [
        EpisodeRows([trajectory_row(episode(_two_turns()), None)], f"s{i}", 1.0) for i in range(2)
    ]
    out = generator_output(
        rows, ["a", "b"], step_wise=False, logprobs=False, routes=False, compact=_compact
    )
    assert out["trajectory_ids"] == ["a", "b"]
    assert out["is_last_step"] is None
    assert out["rollout_logprobs"] is None
    assert out["rollout_expert_indices"] is None
    # Nothing but placeholders under R3: no routes at all (nothing trains).
    masked = [EpisodeRows([placeholder_row(0)], None, 0.0, masked="x")]
    assert (
        generator_output(
            masked, None, step_wise=False, logprobs=True, routes=True, compact=_compact
        )["rollout_expert_indices"]
        is None
    )
