"""`trainers.verl.outputs`: an episode's export as verl's outputs, field by
field (verl's ``AgentLoopOutput`` stood in for by the keyword arguments it
is built with; tests/trainers/verl runs it in the released verl)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from rollout_session.trainers import Episode, EpisodeFailed
from rollout_session.trainers.verl.outputs import Limits, verl_outputs


def segment(index: int, ids: list[int], mask: list[int], prompt_length: int) -> dict[str, Any]:
    sampled = [i for i, m in enumerate(mask) if m]
    return {
        "index": index,
        "token_ids": ids,
        "loss_mask": mask,
        "logprobs": [-0.5 if m else 0.0 for m in mask],
        "prompt_length": prompt_length,
        "messages": [{"role": "user"}, {"role": "assistant"}],
        "turns": [
            {
                "finish_reason": "stop",
                "continuations": [{}],
                "weight_versions": (
                    [{"start": sampled[0], "end": sampled[-1] + 1, "version": "4"}]
                    if sampled
                    else []
                ),
            }
        ],
    }


ONE = segment(0, [1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 0], 3)
TWO = segment(1, [7, 8, 9, 10], [0, 0, 1, 1], 2)


def outputs(segments: list[dict[str, Any]], reward: float | None, **limits: Any) -> list[Any]:
    episode = Episode("s1", {"segments": copy.deepcopy(segments)}, reward)
    settings = {"prompt_length": 100, "response_length": 100, "every_segment": True, **limits}
    return verl_outputs(episode, Limits(**settings), dict, dict)


def test_a_segment_field_by_field() -> None:
    [out] = outputs([ONE], 1.0)
    assert (out["prompt_ids"], out["response_ids"]) == ([1, 2, 3], [4, 5, 6])
    assert out["response_mask"] == [1, 1, 0]
    assert out["response_logprobs"] == [-0.5, -0.5, 0.0]
    assert out["reward_score"] == 1.0 and out["num_turns"] == 2
    assert out["metrics"] == {"num_preempted": 1}
    extra = out["extra_fields"]
    assert (extra["min_global_steps"], extra["max_global_steps"]) == (4, 4)
    assert extra["reward_extra_info"] == {}
    assert extra["rollout_session"]["session_id"] == "s1"


def test_v1_takes_every_segment_the_reward_on_the_last() -> None:
    first, last = outputs([ONE, TWO], 0.5)
    assert first["response_ids"] == [4, 5, 6] and last["response_ids"] == [9, 10]
    assert (first["reward_score"], last["reward_score"]) == (None, 0.5)
    assert first["extra_fields"]["rollout_session"]["segments"] == 2


def test_the_legacy_trainer_takes_the_last_and_says_what_it_drops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "rollout_session.trainers"):
        [out] = outputs([ONE, TWO], 0.5, every_segment=False)
    assert out["response_ids"] == [9, 10]
    session = out["extra_fields"]["rollout_session"]
    assert (session["segments_dropped"], session["sampled_tokens_dropped"]) == (1, 2)
    assert "2 sampled tokens of the earlier segments are not trained on" in caplog.text


def test_caps_as_verls_loops_cap_and_count_what_they_drop(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "rollout_session.trainers"):
        [out] = outputs([ONE], None, prompt_length=2, response_length=2)
    assert (out["prompt_ids"], out["response_ids"], out["response_mask"]) == (
        [2, 3],
        [4, 5],
        [1, 1],
    )
    session = out["extra_fields"]["rollout_session"]
    assert (session["prompt_tokens_dropped"], session["response_tokens_dropped"]) == (1, 1)
    assert "are not trained on" in caplog.text
    assert "reward_extra_info" not in out["extra_fields"]  # verl's reward loop scores it


@pytest.mark.parametrize(
    ("version", "global_steps", "steps"),
    [("4", None, (4, 4)), ("default", 9, (9, 9)), ("default", None, (None, None))],
    ids=["named", "batch-step", "unknown"],
)
def test_steps_from_the_versions(
    version: str, global_steps: int | None, steps: tuple[int | None, int | None]
) -> None:
    labelled = copy.deepcopy(ONE)
    labelled["turns"][0]["weight_versions"][0]["version"] = version
    [out] = outputs([labelled], None, global_steps=global_steps)
    extra = out["extra_fields"]
    assert (extra["min_global_steps"], extra["max_global_steps"]) == steps


def test_an_episode_that_sampled_nothing_is_refused() -> None:
    empty = segment(0, [1, 2], [0, 0], 2)
    with pytest.raises(EpisodeFailed, match="sampled no token"):
        outputs([empty], 1.0)
