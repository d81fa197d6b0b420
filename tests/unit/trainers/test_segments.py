"""An exported segment as token arrays: the prompt and the response, each
turn's step, the routed experts, the policy versions
(rollout_session/trainers/segments.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_session.trainers.segments import (
    SegmentTokens,
    experts_top_k,
    routed_experts,
    segment_steps,
    step_range,
)
from tests.unit.trainers.export_docs import segment

DOC = segment(
    3,
    [
        ([1, 2], [10, 11, 12], "tool_calls", [(3, "4")], 0),
        ([7], [13, 14, 15], "stop", [(1, "4"), (2, "5")], 2),
    ],
    routes=(2, 2),
)


def test_a_segment_as_prompt_and_response() -> None:
    tokens = SegmentTokens.of(DOC)
    assert (tokens.prompt_ids, tokens.response_ids) == ([1, 2], [10, 11, 12, 7, 13, 14, 15])
    assert tokens.response_mask == [1, 1, 1, 0, 1, 1, 1]
    assert tokens.response_versions == ["4", "4", "4", None, "4", "5", "5"]
    assert (tokens.num_turns, tokens.finish_reason, tokens.sampled) == (2, "stop", 6)
    assert step_range(tokens.response_versions) == (4, 5)


def test_each_turn_as_a_step() -> None:
    first, second = segment_steps(DOC)
    assert (first.segment, first.turn, first.prompt_ids, first.response_ids) == (
        3,
        0,
        [1, 2],
        [10, 11, 12],
    )
    assert (second.prompt_ids, second.response_ids) == ([1, 2, 10, 11, 12, 7], [13, 14, 15])
    assert second.response_mask == [1, 1, 1]
    assert second.response_logprobs == [-0.5, -0.51, -0.52]
    assert second.response_versions == ["4", "5", "5"]
    assert (second.finish_reason, second.continuations, second.end) == ("stop", 2, 9)
    without = {k: v for k, v in DOC.items() if k != "turns"}
    with pytest.raises(ValueError, match="include=turns"):
        segment_steps(without)


def test_routed_experts_by_layer() -> None:
    routes = routed_experts(DOC, 2)
    assert routes is not None and routes.shape == (8, 2, 2)
    assert routes[5].tolist() == [[35 % 64, 36 % 64], [38 % 64, 39 % 64]]
    with pytest.raises(ValueError, match="not a multiple of top_k 3"):
        routed_experts(DOC, 3)


def test_the_models_experts_per_token(tmp_path: Path) -> None:
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for folder, config in (
        (moe, {"model_type": "mixtral", "num_experts_per_tok": 2}),
        (dense, {"model_type": "llama"}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config), "utf-8")
    assert experts_top_k(str(moe)) == 2
    with pytest.raises(TypeError, match="num_experts_per_tok"):
        experts_top_k(str(dense))
