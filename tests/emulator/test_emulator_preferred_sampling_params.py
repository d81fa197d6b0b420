"""The SGLang emulator's ``--preferred-sampling-params``, over real sockets:
published by ``/model_info`` and ``/server_info``, merged under every
request's own sampling parameters (``TokenizerManager._create_tokenized_object``:
``{**preferred, **request}``), so ``/generate`` takes what a request leaves
out while the chat route, whose parameters name every key, takes none of
what the emulator models; refused at launch as SGLang refuses it
(docs/emulator.md#launch-flags)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from rollout_session.emulator.cli import add_arguments, config_from_args
from rollout_session.emulator.worker import EmulatorConfig
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import MESSAGES, chat, render, sampled
from tests.emulator.test_emulator_generate import generate, native_error

PREFERRED = {"max_new_tokens": 5, "sampling_seed": 11, "temperature": 0.7}


async def test_model_info_and_server_info_publish_them(serve: Serve) -> None:
    client, _ = await serve(preferred_sampling_params=PREFERRED)
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        assert (await client.get(path)).json()["preferred_sampling_params"] == PREFERRED, path
    plain, _ = await serve()
    assert (await plain.get("/model_info")).json()["preferred_sampling_params"] is None
    assert (await plain.get("/server_info")).json()["preferred_sampling_params"] is None


async def test_generate_takes_what_the_request_leaves_out(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(preferred_sampling_params=PREFERRED, completion_tokens=20)
    plain, _ = await serve(completion_tokens=20)
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True)
    preferred = await generate(client, {"input_ids": prompt})
    explicit = await generate(
        plain, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "sampling_seed": 11}}
    )
    assert preferred["output_ids"] == explicit["output_ids"]
    assert preferred["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    # The request's own keys win, null included (no limit).
    own = await generate(client, {"input_ids": prompt, "sampling_params": {"max_new_tokens": None}})
    assert len(own["output_ids"]) == 20
    assert own["meta_info"]["finish_reason"]["type"] == "stop"


async def test_the_merged_parameters_are_what_samplingparams_checks(
    serve: Serve, tokenizer: Any
) -> None:
    client, _ = await serve(preferred_sampling_params={"temperature": -1.0})
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True)
    refused = await client.post("/generate", json={"input_ids": prompt})
    assert native_error(refused) == "temperature must be a non-negative finite number, got -1.0."
    served = await generate(client, {"input_ids": prompt, "sampling_params": {"temperature": 1}})
    assert served["output_ids"]


async def test_the_chat_route_names_every_key_it_models(serve: Serve, tokenizer: Any) -> None:
    """ChatCompletionRequest.to_sampling_params always sets max_new_tokens
    and sampling_seed (None when the request has none), which the merge keeps."""
    client, _ = await serve(preferred_sampling_params=PREFERRED, completion_tokens=20)
    plain, _ = await serve(completion_tokens=20)
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True)
    body = {"messages": MESSAGES, "input_ids": prompt}
    assert sampled(await chat(client, body)) == sampled(await chat(plain, body))
    assert len(sampled(await chat(client, body))[0]) == 20


@pytest.mark.parametrize(
    ("preferred", "skip", "message"),
    [
        ({"watermark": {"enabled": True}}, False, "watermark is not supported in"),
        ({"foo": 1}, False, "the emulator does not model --preferred-sampling-params"),
        ({"temperature": "hot"}, False, "the emulator does not model --preferred-sampling"),
        ({"json_schema": "{}"}, False, "the emulator does not model a server-wide json_schema"),
        ({"stop": "x"}, True, "stop=['x'] is unavailable when skip_tokenizer_init=True"),
        ({"min_new_tokens": 1}, True, "min_new_tokens=1 is unavailable when skip_tokenizer"),
    ],
    ids=[
        "watermark", "unknown-key", "mistyped", "grammar", "stop-without-tokenizer",
        "min-new-tokens-without-tokenizer",
    ],
)  # fmt: skip
def test_launch_refusals(preferred: dict[str, Any], skip: bool, message: str) -> None:
    """arg_groups/serving_hook.py handle_other_validations (and what the
    emulator does not model)."""
    with pytest.raises(ValueError) as refused:
        EmulatorConfig(preferred_sampling_params=preferred, skip_tokenizer_init=skip)
    assert str(refused.value).startswith(message)


def test_a_stop_string_is_fine_with_a_tokenizer() -> None:
    assert EmulatorConfig(preferred_sampling_params={"stop": "x"}).preferred_sampling_params


def test_the_flag_takes_json() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(
        parser.parse_args(["--preferred-sampling-params", '{"max_new_tokens": 5}'])
    )
    assert config.preferred_sampling_params == {"max_new_tokens": 5}
    with pytest.raises(SystemExit):
        parser.parse_args(["--preferred-sampling-params", "{nope"])
    with pytest.raises(ValueError, match="must be a JSON object"):
        config_from_args(parser.parse_args(["--preferred-sampling-params", "[1]"]))
    with pytest.raises(ValueError, match="preferred_sampling_params is a flag of engine 'sglang'"):
        EmulatorConfig(engine="vllm", preferred_sampling_params={"max_new_tokens": 5})
