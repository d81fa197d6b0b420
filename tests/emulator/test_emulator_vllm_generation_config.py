"""The vLLM emulator's ``--generation-config`` and ``--override-generation-config``,
over real sockets: what ``/v1/chat/completions/render`` puts in
``sampling_params`` for a request that sets no sampling key
(``ModelConfig.get_diff_sampling_param``: the model directory's
``generation_config.json``, none, or a folder's, under the override), the
``max_tokens`` cap a folder's or the override's ``max_new_tokens`` sets, and
``/inference/v1/generate``'s default ``max_tokens`` (docs/emulator.md#flags)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rollout_session.emulator.cli import add_arguments, config_from_args
from rollout_session.emulator.tokenizer import bundled_tokenizer_path
from rollout_session.emulator.worker import EmulatorConfig
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import MESSAGES, render
from tests.emulator.test_emulator_vllm import VLLM, generate
from tests.emulator.test_emulator_vllm_render import rendered

CONTEXT = 4096
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 300}
PENALTY = {"repetition_penalty": 1.1, "skip_special_tokens": False}
# The chat route's own floats (CP _DEFAULT_SAMPLING_PARAMS) when nothing overrides them.
PLAIN = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "temperature": 1.0, "top_p": 1.0, "min_p": 0.0,
}  # fmt: skip


def _model_dir(target: Path, generation: dict[str, Any]) -> Path:
    """The bundled tokenizer's directory with ``generation`` in its
    generation_config.json (its end tokens kept)."""
    target.mkdir()
    source = bundled_tokenizer_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, target / name)
    config = json.loads((source / "generation_config.json").read_text("utf-8"))
    (target / "generation_config.json").write_text(json.dumps({**config, **generation}), "utf-8")
    return target


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return _model_dir(tmp_path / "model", MODEL_DEFAULTS)


def _sampling(answer: dict[str, Any]) -> dict[str, Any]:
    sampling: dict[str, Any] = answer["sampling_params"]
    return sampling


def _room(tokenizer: Any) -> int:
    return CONTEXT - len(render(tokenizer, MESSAGES, add_generation_prompt=True))


@pytest.mark.parametrize(
    ("flags", "expected", "max_tokens"),
    [
        ({}, {"temperature": 0.6, "top_p": 0.95, "top_k": 20}, 300),
        ({"generation_config": "vllm"}, {}, None),
        ({"override_generation_config": {"temperature": 0.2}}, {"temperature": 0.2}, 300),
        (
            {"generation_config": "vllm", "override_generation_config": {"top_k": 5}},
            {"top_k": 5},
            None,
        ),
        ({"override_generation_config": {"max_new_tokens": 40}}, {}, 40),
        ({"override_generation_config": PENALTY}, PENALTY, 300),
    ],
    ids=[
        "auto", "vllm", "override-over-auto", "override-over-vllm", "override-max-new-tokens",
        "override-penalty-and-skip",
    ],
)  # fmt: skip
async def test_render_takes_the_servers_defaults(
    serve: Serve,
    tokenizer: Any,
    model_dir: Path,
    flags: dict[str, Any],
    expected: dict[str, Any],
    max_tokens: int | None,
) -> None:
    """A request without sampling keys: CP to_sampling_params takes each from
    get_diff_sampling_param (auto: the model's file, then the override)."""
    client, _ = await serve(**VLLM, tokenizer_path=model_dir, context_length=CONTEXT, **flags)
    sampling = _sampling(await rendered(client, {"messages": MESSAGES}))
    auto = flags.get("generation_config", "auto") == "auto"
    wanted = {**PLAIN, **({"temperature": 0.6, "top_p": 0.95} if auto else {}), **expected}
    for key, value in wanted.items():
        assert sampling[key] == value, key
    top_k = expected.get("top_k", 20 if auto else None)
    assert sampling.get("top_k") == top_k
    assert sampling.get("skip_special_tokens", True) is expected.get("skip_special_tokens", True)
    assert sampling["max_tokens"] == min(_room(tokenizer), max_tokens or _room(tokenizer))


async def test_the_requests_own_values_win(serve: Serve, model_dir: Path) -> None:
    client, _ = await serve(
        **VLLM, tokenizer_path=model_dir, override_generation_config={"temperature": 0.2}
    )
    body = {"messages": MESSAGES, "temperature": 0.9, "top_k": 3, "max_tokens": 200}
    sampling = _sampling(await rendered(client, body))
    assert (sampling["temperature"], sampling["top_k"], sampling["top_p"]) == (0.9, 3, 0.95)
    assert sampling["max_tokens"] == 200  # auto: the model's max_new_tokens is no cap


@pytest.mark.parametrize(
    ("flags", "cap"),
    [
        ({"override_generation_config": {"max_new_tokens": 50}}, 50),
        ({"generation_config": "FOLDER"}, 60),
        ({"generation_config": "FOLDER", "override_generation_config": {"max_new_tokens": 70}}, 70),
    ],
    ids=["override", "folder", "override-over-folder"],
)
async def test_a_cap_on_an_explicit_max_tokens(
    serve: Serve, tmp_path: Path, model_dir: Path, flags: dict[str, Any], cap: int
) -> None:
    """ServingRender.override_max_tokens: a folder's max_new_tokens, or with
    auto or vllm the override's, caps even a request's max_tokens."""
    folder = _model_dir(tmp_path / "folder", {"max_new_tokens": 60, "temperature": 0.3})
    if flags.get("generation_config") == "FOLDER":
        flags = {**flags, "generation_config": str(folder)}
    client, _ = await serve(**VLLM, tokenizer_path=model_dir, **flags)
    sampling = _sampling(await rendered(client, {"messages": MESSAGES, "max_tokens": 100}))
    assert sampling["max_tokens"] == cap
    if "generation_config" in flags:  # the folder's defaults, not the model's
        assert (sampling["temperature"], sampling.get("top_k")) == (0.3, None)


async def test_a_folder_without_a_generation_config_has_no_defaults(
    serve: Serve, tmp_path: Path, model_dir: Path
) -> None:
    """try_get_generation_config finds none: vLLM's own defaults."""
    client, _ = await serve(**VLLM, tokenizer_path=model_dir, generation_config=str(tmp_path))
    sampling = _sampling(await rendered(client, {"messages": MESSAGES}))
    assert (sampling["temperature"], sampling["top_p"], sampling.get("top_k")) == (1.0, 1.0, None)


async def test_every_value_the_file_sets_is_a_default(serve: Serve, tmp_path: Path) -> None:
    """to_diff_dict under the transformers vLLM 0.33.0 requires (5.x, whose
    GenerationConfig defaults are None) keeps 1.0 and top_k 50 too."""
    folder = _model_dir(tmp_path / "model", {"temperature": 1.0, "top_k": 50})
    client, _ = await serve(**VLLM, tokenizer_path=folder)
    sampling = _sampling(await rendered(client, {"messages": MESSAGES}))
    assert (sampling["temperature"], sampling["top_k"]) == (1.0, 50)


@pytest.mark.parametrize(
    ("flags", "sent", "tokens"),
    [
        ({}, {}, 20),
        ({"override_generation_config": {"max_new_tokens": 7}}, {}, 7),
        ({"override_generation_config": {"max_new_tokens": 7}}, {"max_tokens": 100}, 20),
        ({"generation_config": "vllm"}, {}, 20),
    ],
    ids=["model-default", "override-default", "explicit-not-capped", "vllm"],
)
async def test_generate_takes_only_the_default_max_tokens(
    serve: Serve,
    tokenizer: Any,
    tmp_path: Path,
    flags: dict[str, Any],
    sent: dict[str, Any],
    tokens: int,
) -> None:
    """ServingTokens applies get_max_tokens only to a request without
    max_tokens (no other model default: the body's parameters are the
    engine's)."""
    model = _model_dir(tmp_path / "model", {"max_new_tokens": 12})
    client, _ = await serve(**VLLM, tokenizer_path=model, completion_tokens=20, **flags)
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True)
    answer = await generate(client, {"token_ids": prompt, "sampling_params": sent})
    expected = 12 if not flags else tokens
    [choice] = answer["choices"]
    assert len(choice["token_ids"]) == expected
    assert choice["finish_reason"] == ("length" if expected < 20 else "stop")


@pytest.mark.parametrize(
    "flags",
    [
        {"engine": "sglang", "generation_config": "vllm"},
        {"engine": "sglang", "override_generation_config": {"temperature": 0.5}},
        {**VLLM, "override_generation_config": ["temperature"]},
        {**VLLM, "override_generation_config": {"temperature": "hot"}},
        {**VLLM, "override_generation_config": {"max_new_tokens": 1.5}},
        {**VLLM, "override_generation_config": {"skip_special_tokens": 0}},
        {**VLLM, "generation_config": ""},
    ],
    ids=[
        "sglang-generation-config", "sglang-override", "not-an-object", "mistyped-temperature",
        "mistyped-max-new-tokens", "mistyped-skip", "empty",
    ],
)  # fmt: skip
def test_config_refusals(flags: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EmulatorConfig(**flags)


def test_the_flags_are_vllms() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(
        parser.parse_args(
            [
                "--engine", "vllm", "--generation-config", "vllm",
                "--override-generation-config", '{"temperature": 0.5}',
            ]
        )
    )  # fmt: skip
    assert config.generation_config == "vllm"
    assert config.override_generation_config == {"temperature": 0.5}
    assert config_from_args(parser.parse_args(["--engine", "vllm"])).generation_config == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine", "vllm", "--override-generation-config", "{nope"])
