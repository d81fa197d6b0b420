"""The SGLang emulator launched with ``--skip-tokenizer-init`` (how verl
launches SGLang), over real sockets: ``/generate`` answers ids and
``meta_info`` without ``text`` (logprob entries without their token's text),
refuses text prompts, stop strings, stop regexes and ``min_new_tokens`` with
SGLang's messages and still stops on the end token; the chat route fails
after the request ran, as SGLang's does without text (but answers one
aborted in the waiting queue); the parse routes parse text as before
(docs/emulator.md#launch-flags)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from rollout_session.emulator.app import start_emulator
from rollout_session.emulator.cli import add_arguments, config_from_args
from rollout_session.emulator.tokenizer import bundled_tokenizer_path
from rollout_session.emulator.worker import EmulatorConfig
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import FLAT_ERROR_KEYS, MESSAGES, TOOLS, render
from tests.emulator.test_emulator_generate import generate, native_error
from tests.emulator.test_emulator_weights import WAITING, Calls, post

SKIP: dict[str, Any] = {"skip_tokenizer_init": True}
TEXT_PROMPT = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)


def _prompt(tokenizer: Any, **kwargs: Any) -> list[int]:
    return render(tokenizer, MESSAGES, add_generation_prompt=True, **kwargs)


async def test_generate_answers_ids_without_text(serve: Serve, tokenizer: Any) -> None:
    """TokenizerManager._handle_batch_output, BatchTokenIDOutput: output_ids
    and meta_info only; the same sample, stopped on the same end token."""
    skipping, _ = await serve(**SKIP)
    plain, _ = await serve()
    body = {"input_ids": _prompt(tokenizer), "sampling_params": {"sampling_seed": 3}}
    answer = await generate(skipping, body)
    reference = await generate(plain, body)
    assert list(answer) == ["output_ids", "meta_info"]
    assert answer["output_ids"] == reference["output_ids"]
    assert answer["output_ids"][-1] == tokenizer.eos_token_id
    assert answer["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": tokenizer.eos_token_id,
    }
    asked = await generate(skipping, {**body, "return_prompt_token_ids": True})
    assert list(asked) == ["output_ids", "meta_info", "prompt_token_ids"]


async def test_logprob_entries_carry_no_text(serve: Serve, tokenizer: Any) -> None:
    """return_text_in_logprobs and not skip_tokenizer_init: no text."""
    client, _ = await serve(**SKIP)
    prompt = _prompt(tokenizer)
    answer = await generate(
        client,
        {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 0,
            "return_text_in_logprobs": True,
        },
    )
    meta = answer["meta_info"]
    assert [e[2] for e in meta["input_token_logprobs"]] == [None] * len(prompt)
    assert [e[2] for e in meta["output_token_logprobs"]] == [None] * len(answer["output_ids"])


async def test_a_text_prompt_is_refused(serve: Serve, tokenizer: Any) -> None:
    """_tokenize_one_request without a tokenizer; beside input_ids, text is
    ignored (the ids are the prompt)."""
    client, _ = await serve(**SKIP)
    refused = await client.post("/generate", json={"text": "hello"})
    assert native_error(refused) == TEXT_PROMPT
    prompt = _prompt(tokenizer)
    both = await generate(client, {"text": "hello", "input_ids": prompt})
    assert both["meta_info"]["prompt_tokens"] == len(prompt)


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"stop": "x"}, "stop=['x'] is unavailable when skip_tokenizer_init=True"),
        ({"stop": ["a", "b"]}, "stop=['a', 'b'] is unavailable when skip_tokenizer_init=True"),
        ({"stop": ""}, "stop=[''] is unavailable when skip_tokenizer_init=True"),
        ({"stop_regex": "\\d"}, "stop_regex=['\\\\d'] is unavailable when skip_tokenizer_init"),
        ({"min_new_tokens": 2}, "min_new_tokens=2 is unavailable when skip_tokenizer_init=True"),
        ({"stop": ["x"] * 33}, "at most 32 stop strings are allowed, got 33"),
    ],
    ids=["stop", "stops", "empty-stop", "stop-regex", "min-new-tokens", "too-many-first"],
)
async def test_what_needs_a_tokenizer_is_refused(
    serve: Serve, tokenizer: Any, sampling: dict[str, Any], message: str
) -> None:
    """SamplingParams.normalize(None): raise_if_tokenizer_required, after
    the stop counts."""
    client, _ = await serve(**SKIP)
    response = await client.post(
        "/generate", json={"input_ids": _prompt(tokenizer), "sampling_params": sampling}
    )
    assert native_error(response).startswith(message)


@pytest.mark.parametrize(
    "sampling",
    [{"stop": []}, {"stop": None}, {"min_new_tokens": 0}, {"stop_token_ids": [5]}],
    ids=["no-stops", "null-stop", "zero-min-new-tokens", "stop-token-ids"],
)
async def test_what_needs_no_tokenizer_is_served(
    serve: Serve, tokenizer: Any, sampling: dict[str, Any]
) -> None:
    client, _ = await serve(**SKIP)
    answer = await generate(client, {"input_ids": _prompt(tokenizer), "sampling_params": sampling})
    assert answer["output_ids"]


async def test_the_chat_route_fails_after_the_request_ran(serve: Serve, tokenizer: Any) -> None:
    """serving_chat._build_chat_response reads ret_item["text"]: a KeyError
    once the request ran, which handle_request answers as an internal error."""
    client, emulator = await serve(**SKIP, tool_call_parser="qwen25")
    prompt = _prompt(tokenizer, tools=TOOLS)
    response = await client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "input_ids": prompt}
    )
    assert response.status_code == 500
    assert response.json() == {
        "object": "error",
        "message": "Internal server error: 'text'",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    assert (emulator.completed, emulator.prompt_tokens) == (1, len(prompt))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stop": "x"}, "stop=['x'] is unavailable"),
        ({"stop_regex": ["a+"]}, "stop_regex=['a+'] is unavailable"),
        ({"min_tokens": 3}, "min_new_tokens=3 is unavailable"),
    ],
    ids=["stop", "stop-regex", "min-tokens"],
)
async def test_the_chat_route_refuses_what_needs_a_tokenizer(
    serve: Serve, tokenizer: Any, fields: dict[str, Any], message: str
) -> None:
    """The tokenizer manager's ValueError, answered by the chat route as a 400."""
    client, emulator = await serve(**SKIP)
    response = await client.post(
        "/v1/chat/completions", json={"input_ids": _prompt(tokenizer), **fields}
    )
    assert response.status_code == 400
    body = response.json()
    assert set(body) == FLAT_ERROR_KEYS and body["type"] == "BadRequestError"
    assert body["message"].startswith(message)
    assert emulator.prompt_tokens == 0


async def test_an_abort_in_the_waiting_queue_is_answered_with_empty_text(
    autojump_clock: trio.testing.MockClock, serve: Serve, tokenizer: Any
) -> None:
    """_handle_abort_req answers with the request state's text, "" without a
    tokenizer: /generate has text again, and the chat route can answer."""
    autojump_clock.autojump_threshold = 0.02
    client, emulator = await serve(**SKIP, base_latency_s=5.0)
    prompt = _prompt(tokenizer)
    async with trio.open_nursery() as nursery:
        calls = Calls(nursery)
        calls.start("generate", lambda: generate(client, {"input_ids": prompt, "rid": "generate"}))
        calls.start(
            "chat",
            lambda: client.post(
                "/v1/chat/completions",
                json={"input_ids": prompt, "rid": "chat", "return_meta_info": True},
            ),
        )
        await emulator.wait_until(lambda: {"generate", "chat"} <= emulator.running)
        await post(client, "/abort_request", {"abort_all": True})
    answer = calls.answers["generate"]
    assert (answer["text"], answer["output_ids"]) == ("", [])
    assert answer["meta_info"]["finish_reason"] == WAITING
    chat = calls.answers["chat"]
    assert chat.status_code == 200, chat.text
    [choice] = chat.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": ""}
    assert choice["meta_info"]["finish_reason"] == WAITING


async def test_the_parse_routes_parse_text_as_before(serve: Serve, tokenizer: Any) -> None:
    """Their detectors need no tokenizer: the client decodes the ids and
    parses the text."""
    client, _ = await serve(**SKIP)
    prompt = _prompt(tokenizer, tools=TOOLS)
    answer = await generate(client, {"input_ids": prompt, "sampling_params": {}})
    text = tokenizer.decode(answer["output_ids"][:-1])
    parsed = await client.post(
        "/parse_function_call", json={"text": text, "tools": TOOLS, "tool_call_parser": "qwen25"}
    )
    assert parsed.status_code == 200, parsed.text
    [call] = parsed.json()["calls"]
    assert call["name"] == "read_file" and json.loads(call["parameters"])


async def test_server_info_publishes_it(serve: Serve) -> None:
    client, _ = await serve(**SKIP)
    assert (await client.get("/server_info")).json()["skip_tokenizer_init"] is True
    plain, _ = await serve()
    assert (await plain.get("/server_info")).json()["skip_tokenizer_init"] is False


def test_the_flag_is_sglangs() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--skip-tokenizer-init"]))
    assert config.skip_tokenizer_init is True
    with pytest.raises(ValueError, match="skip_tokenizer_init is a flag of engine 'sglang'"):
        EmulatorConfig(engine="vllm", skip_tokenizer_init=True)


async def test_a_model_without_generation_config_eos_is_not_modelled(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Without a tokenizer SGLang stops on the model config's EOS ids alone;
    the emulator's model would stop on the tokenizer's."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled_tokenizer_path() / name, tmp_path / name)
    with pytest.raises(ValueError, match="does not model --skip-tokenizer-init"):
        await start_emulator(nursery, EmulatorConfig(tokenizer_path=tmp_path, **SKIP))
