"""`trainers.segments`: an exported segment as a trainer's arrays."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollout_session.trainers.segments import (
    SegmentTokens,
    experts_top_k,
    rescore_logprobs,
    routed_experts,
    segment_steps,
    step_range,
    version_step,
)
from tests.unit.trainers.export_docs import segment

# A segment of 3 prompt tokens, a 2-token answer, 2 appended tokens (a tool
# result) and a 1-token answer whose first token was sampled under "7".
SEGMENT: dict[str, Any] = {
    "index": 0,
    "token_ids": [1, 2, 3, 10, 11, 20, 21, 30],
    "loss_mask": [0, 0, 0, 1, 1, 0, 0, 1],
    "logprobs": [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0],
    "prompt_length": 3,
    "turns": [
        {
            "finish_reason": "tool_calls",
            "weight_versions": [{"start": 3, "end": 5, "version": "6"}],
        },
        {"finish_reason": "stop", "weight_versions": [{"start": 7, "end": 8, "version": "7"}]},
    ],
}


def test_a_segment_splits_where_the_model_first_sampled() -> None:
    tokens = SegmentTokens.of(SEGMENT)
    assert tokens.prompt_ids == [1, 2, 3]
    assert tokens.response_ids == [10, 11, 20, 21, 30]
    assert tokens.response_mask == [1, 1, 0, 0, 1]
    assert tokens.response_logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert tokens.response_versions == ["6", "6", None, None, "7"]
    assert (tokens.num_turns, tokens.finish_reason, tokens.sampled) == (2, "stop", 3)


@pytest.mark.parametrize(
    ("version", "step"),
    [("12", 12), (" 3 ", 3), ("default", None), ("v1", None), ("-1", None), (None, None)],
    ids=["decimal", "padded", "worker-label", "prefixed", "negative", "unsampled"],
)
def test_a_version_is_a_step_only_when_it_is_a_decimal(
    version: str | None, step: int | None
) -> None:
    assert version_step(version) == step


@pytest.mark.parametrize(
    ("versions", "unnamed", "expected"),
    [
        (["6", None, "7"], None, (6, 7)),
        (["default", "7"], 5, (5, 7)),
        (["default", "7"], None, (7, 7)),
        (["default"], None, None),
        ([None, None], 4, None),
    ],
    ids=["steps", "label-as-batch-step", "label-unknown", "nothing-known", "nothing-sampled"],
)
def test_step_range(
    versions: list[str | None], unnamed: int | None, expected: tuple[int, int] | None
) -> None:
    assert step_range(versions, unnamed) == expected


def test_routed_experts_are_positions_by_layers_by_top_k() -> None:
    flat = np.arange(2 * 4 * 2, dtype=np.int16)
    segment = {
        "routed_experts": {
            "shape": [2, 8],
            "dtype": "int16",
            "data": base64.b64encode(flat.tobytes()).decode(),
        }
    }
    rows = routed_experts(segment, top_k=2)
    assert rows is not None and rows.shape == (2, 4, 2)
    assert rows[1, 3].tolist() == [14, 15]
    with pytest.raises(ValueError, match="not a multiple of top_k 3"):
        routed_experts(segment, top_k=3)
    assert routed_experts({"routed_experts": None}, top_k=2) is None


def test_a_rescore_by_label() -> None:
    segment = {"rescores": {"teacher": {"logprobs": [None, -0.1, -0.2]}}}
    assert rescore_logprobs(segment, "teacher") == [None, -0.1, -0.2]
    assert rescore_logprobs(segment, "other") is None
    assert rescore_logprobs({}, "teacher") is None


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


def test_routed_experts_of_an_export_by_layer() -> None:
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
