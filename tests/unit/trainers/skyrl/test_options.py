"""The generator's options from SkyRL's config with keywords over them, and
SkyRL's sampling as the session's (rollout_session/trainers/skyrl/options.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollout_session.trainers.skyrl.options import (
    UNSET,
    pinned_sampling,
    resolve_options,
    wants_logprobs,
)
from tests.trainers.agents import tool_agent

AGENT = "tests.trainers.agents:tool_agent"


def _cfg(**section: Any) -> Any:
    """A config of SkyRL's shape (``generator.rollout_session`` …)."""
    return SimpleNamespace(
        generator=SimpleNamespace(
            rollout_session=SimpleNamespace(
                **{"servers": ["http://a:1/"], "agent": AGENT, **section}
            ),
            step_wise_trajectories=True,
            inference_engine=SimpleNamespace(enable_return_routed_experts=False),
            sampling_params=SimpleNamespace(logprobs=None),
        ),
        trainer=SimpleNamespace(policy=SimpleNamespace(model=SimpleNamespace(path="/nonexistent"))),
    )


def test_the_config_with_keywords_over_it() -> None:
    options = resolve_options(_cfg(workers=["h:1", "h:2"], on_error="raise"), {})
    assert options.servers == ("http://a:1",)
    assert options.agent is tool_agent
    assert options.workers == ("h:1", "h:2")
    assert (options.on_error, options.weight_sync, options.max_concurrency) == (
        "raise",
        "abort",
        256,
    )
    assert options.step_wise is True
    assert options.experts_top_k is None
    # A keyword replaces its option, None included; UNSET leaves it.
    options = resolve_options(
        _cfg(workers=["h:1"]),
        {
            "workers": None,
            "weight_sync": None,
            "step_wise": False,
            "agent": UNSET,
            "servers": ["http://b:2"],
        },
    )
    assert (options.workers, options.weight_sync, options.step_wise) == (None, None, False)
    assert options.servers == ("http://b:2",)
    assert options.agent is tool_agent


def test_without_a_config() -> None:
    options = resolve_options(None, {"servers": ["http://a:1"], "agent": tool_agent})
    assert (options.workers, options.step_wise, options.experts_top_k) == ("skyrl", False, None)
    # R3 named by keyword: its top-k too, or the model's config is read.
    options = resolve_options(
        None,
        {
            "servers": ["http://a:1"],
            "agent": tool_agent,
            "routed_experts": True,
            "experts_top_k": 8,
        },
    )
    assert options.experts_top_k == 8


def test_r3_reads_the_models_top_k(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mixtral", "num_experts_per_tok": 3}), "utf-8"
    )
    cfg = _cfg()
    cfg.generator.inference_engine.enable_return_routed_experts = True
    cfg.trainer.policy.model.path = str(tmp_path)
    assert resolve_options(cfg, {}).experts_top_k == 3
    assert resolve_options(cfg, {"experts_top_k": 4}).experts_top_k == 4


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"servers": "http://a:1"}, "a list"),
        ({"servers": []}, "a list"),
        ({"agent": ""}, "package.module:function"),
        ({"agent": "nowhere_at_all:solve"}, "cannot import"),
        ({"workers": "verl"}, "'skyrl', a list of URLs, or null"),
        ({"weight_sync": "keep"}, "'abort', 'drain', null"),
        ({"on_error": "drop"}, "'mask', 'raise'"),
        ({"max_concurrency": 0}, "≥ 1"),
    ],
    ids=[
        "servers-str",
        "servers-empty",
        "agent",
        "agent-import",
        "workers",
        "sync",
        "on-error",
        "concurrency",
    ],
)
def test_refusals_name_the_option(section: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        resolve_options(_cfg(**section), {})


# SkyRL's vLLM sampling dict for the defaults (engine_utils.py
# get_vllm_sampling_params), with additional_kwargs.
SKYRL_SAMPLING = {
    "min_tokens": 1,
    "skip_special_tokens": True,
    "include_stop_str_in_output": True,
    "max_tokens": 1024,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "logprobs": 1,
    "stop": None,
    "repetition_penalty": 1.05,
    "seed": 7,
}


def test_skyrls_sampling_pinned() -> None:
    pinned, unpinned = pinned_sampling(SKYRL_SAMPLING)
    assert pinned == {
        "max_tokens": 1024,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.05,
        "seed": 7,
    }
    # What could change the sampling but no session can pin: said.
    assert unpinned == {"min_tokens": 1}
    pinned, unpinned = pinned_sampling(
        {**SKYRL_SAMPLING, "stop": ["</answer>"], "min_tokens": 0, "n": 2}
    )
    assert unpinned == {"stop": ["</answer>"], "n": 2}
    assert pinned_sampling(None) == ({}, {})


def test_logprobs_by_skyrls_rule() -> None:
    assert wants_logprobs({"logprobs": 1}, None)
    assert wants_logprobs({"logprobs": 0}, None)
    assert not wants_logprobs({"logprobs": None}, None)
    assert not wants_logprobs({}, None)
    # No sampling dict in the batch: the config's.
    assert not wants_logprobs(None, _cfg())
    assert wants_logprobs(None, None)


def test_what_it_pins_is_what_a_session_pins_and_records() -> None:
    """The adapter sits on the client and cannot import the server's list of
    pinnable keys (turn/sampling.py), nor the engines' recorded ones
    (engines/sampling.py): the three say the same keys."""
    from rollout_session.engines.sampling import SAMPLING_KEYS
    from rollout_session.trainers.skyrl.options import PINNED
    from rollout_session.turn.sampling import PINNED_KEYS

    assert set(PINNED) == set(PINNED_KEYS) == set(SAMPLING_KEYS)
