"""The SGLang emulator's ``--tool-call-parser`` and ``--reasoning-parser``,
SGLang 0.5.23's names and launch checks, over real sockets: the chat route
parses tool calls and reasoning only with them (and the request's
``separate_reasoning``, tools and ``tool_choice``), as ``serving_chat``
decides; ``reasoning_tokens`` needs the reasoning parser; ``/server_info``
and ``/model_info`` publish the resolved names; the parse routes keep
taking the parser from the body (docs/emulator.md#launch-flags)."""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import pytest

from rollout_session.emulator.cli import add_arguments, config_from_args
from rollout_session.emulator.sglang.names import REASONING_PARSERS, TOOL_CALL_PARSERS
from rollout_session.emulator.worker import EmulatorConfig
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import FLAT_ERROR_KEYS, MESSAGES, TOOLS, chat, render, sampled
from tests.emulator.test_emulator_generate import ASK_ALL, QWEN3, generate
from tests.sglang_source import or_skip, sglang_root

THINKING: dict[str, Any] = {"chat_template": QWEN3, "reasoning": True}


# -- names and launch checks --------------------------------------------------------


def test_the_parser_names_are_sglangs_own() -> None:
    """The registries as the 0.5.23 wheel lists them (its dependency-free name
    modules, which SGLang's own test keeps equal to the parser maps)."""
    root = or_skip(sglang_root)
    namespace: dict[str, Any] = {}
    exec((root / "srt/function_call/parser_names.py").read_text("utf-8"), namespace)
    exec((root / "srt/parser/reasoning_parser_names.py").read_text("utf-8"), namespace)
    assert list(TOOL_CALL_PARSERS) == namespace["TOOL_CALL_PARSER_NAMES"]
    assert list(REASONING_PARSERS) == namespace["REASONING_PARSER_NAMES"]


@pytest.mark.parametrize(
    "parsers",
    [
        {"tool_call_parser": "qwen25"},
        {"tool_call_parser": "qwen"},
        {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"},
        {"tool_call_parser": "llama3"},
        {"tool_call_parser": "mistral"},
        {"tool_call_parser": "deepseekv3", "reasoning_parser": "deepseek-r1"},
        {"tool_call_parser": "deepseekv31", "reasoning_parser": "deepseek-v3"},
        {"tool_call_parser": "glm45", "reasoning_parser": "glm45"},
        {"tool_call_parser": "kimi_k2", "reasoning_parser": "kimi_k2"},
        {"tool_call_parser": "qwen3_coder"},
        {"tool_call_parser": "gpt-oss", "reasoning_parser": "gpt-oss"},
    ],
    ids=lambda p: "+".join(p.values()),
)
def test_sglangs_names_are_taken(parsers: dict[str, Any]) -> None:
    config = EmulatorConfig(**parsers)
    assert (config.tool_call_parser, config.reasoning_parser) == (
        parsers.get("tool_call_parser"),
        parsers.get("reasoning_parser"),
    )


@pytest.mark.parametrize(
    ("parsers", "message"),
    [
        (
            {"tool_call_parser": "qwen3_json"},
            "argument --tool-call-parser: invalid choice: 'qwen3_json' "
            "(choose from 'auto', 'apertus2509', ",
        ),
        (
            {"reasoning_parser": "deepseek_r1"},
            "argument --reasoning-parser: invalid choice: 'deepseek_r1' "
            "(choose from 'auto', 'apertus2509', 'beam', 'deepseek-r1', ",
        ),
        ({"tool_call_parser": "auto"}, "the emulator does not model --tool-call-parser auto"),
        ({"reasoning_parser": "auto"}, "the emulator does not model --reasoning-parser auto"),
        (
            {"tool_call_parser": "deepseekv32"},
            "the emulator does not model --tool-call-parser deepseekv32: SGLang's chat route",
        ),
        ({"tool_call_parser": "kimi_k3"}, "the emulator does not model --tool-call-parser kimi_k3"),
        (
            {"reasoning_parser": "response_template"},
            "the emulator does not model --reasoning-parser response_template",
        ),
    ],
    ids=[
        "vllm-tool-name", "vllm-reasoning-name", "auto-tool", "auto-reasoning", "chat-encoder",
        "kimi-k3-encoder", "response-template",
    ],
)  # fmt: skip
def test_names_sglang_refuses_or_the_emulator_does_not_model(
    parsers: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        EmulatorConfig(**parsers)
    assert str(refused.value).startswith(message)


def test_the_cli_takes_sglangs_spellings() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(
        parser.parse_args(["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"])
    )
    assert (config.engine, config.tool_call_parser, config.reasoning_parser) == (
        "sglang",
        "qwen25",
        "qwen3",
    )
    with pytest.raises(ValueError, match="enable_auto_tool_choice is a flag of engine 'vllm'"):
        config_from_args(parser.parse_args(["--enable-auto-tool-choice"]))
    with pytest.raises(ValueError, match="invalid choice: 'qwen3_json'"):
        config_from_args(parser.parse_args(["--tool-call-parser", "qwen3_json"]))


@pytest.mark.parametrize(
    ("parsers", "published"),
    [
        ({}, (None, None)),
        ({"tool_call_parser": "qwen25"}, ("qwen", None)),
        ({"tool_call_parser": "glm45", "reasoning_parser": "glm45"}, ("glm", "glm45")),
        ({"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}, ("hermes", "qwen3")),
    ],
    ids=["none", "qwen25-deprecated", "glm45-deprecated", "hermes-qwen3"],
)
async def test_info_routes_publish_the_resolved_parsers(
    serve: Serve, parsers: dict[str, Any], published: tuple[str | None, str | None]
) -> None:
    """serving_hook.handle_deprecated_args resolves qwen25 and glm45; the
    resolved name is the server arg /server_info reports and /model_info's."""
    client, _ = await serve(**parsers)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        info = (await client.get(path)).json()
        assert (info["tool_call_parser"], info["reasoning_parser"]) == published, path


async def test_model_info_has_sglangs_keys(serve: Serve) -> None:
    client, _ = await serve(tool_call_parser="qwen25", model_name="m/one", weight_version="w1")
    info = (await client.get("/model_info")).json()
    # http_server.py model_info, in its order.
    assert list(info) == [
        "model_path", "served_model_name", "tokenizer_path", "is_generation",
        "preferred_sampling_params", "weight_version", "load_format", "reasoning_parser",
        "tool_call_parser", "disaggregation_mode", "has_image_understanding",
        "has_audio_understanding", "model_type", "architectures",
    ]  # fmt: skip
    assert (info["preferred_sampling_params"], info["disaggregation_mode"]) == (None, "null")
    assert (info["weight_version"], info["tool_call_parser"]) == ("w1", "qwen")


# -- the chat route -----------------------------------------------------------------


async def _both(
    client: httpx.AsyncClient,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    body_tools: bool = True,
    **fields: Any,
) -> tuple[dict[str, Any], str]:
    """The chat answer for the rendered prompt, and /generate's text of the
    same sample (special tokens as the chat route keeps them)."""
    kwargs: dict[str, Any] = {"chat_template": template} if template else {}
    prompt = render(tokenizer, messages, tools=tools, add_generation_prompt=True, **kwargs)
    body: dict[str, Any] = {"messages": messages, "input_ids": prompt, "seed": 4, **fields}
    if tools and body_tools:
        body["tools"] = tools
    answer = await chat(client, body)
    skip = not (tools and body_tools)
    sampling = {"sampling_seed": 4, "max_new_tokens": None, "skip_special_tokens": skip}
    text = (await generate(client, {"input_ids": prompt, "sampling_params": sampling}))["text"]
    return answer, text


async def test_without_a_tool_parser_the_call_stays_in_the_content(
    serve: Serve, tokenizer: Any
) -> None:
    """SGLang's default: no tool-call parser, so the model's <tool_call>
    text is the content and the finish reason stays "stop"."""
    client, _ = await serve()
    answer, text = await _both(client, tokenizer, MESSAGES, tools=TOOLS)
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert text.startswith("<tool_call>\n{")
    assert choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == tokenizer.eos_token_id
    assert choice["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": tokenizer.eos_token_id,
    }


@pytest.mark.parametrize(
    ("fields", "body_tools"),
    [({}, False), ({"tool_choice": "none"}, True)],
    ids=["no-tools-in-the-request", "tool-choice-none"],
)
async def test_a_tool_parser_parses_only_for_a_request_that_lets_it(
    serve: Serve, tokenizer: Any, fields: dict[str, Any], body_tools: bool
) -> None:
    """_tool_call_parsing_active: tools, and tool_choice other than "none"
    (without tools, only minimax-m3's detector parses)."""
    client, _ = await serve(tool_call_parser="qwen25")
    answer, _ = await _both(
        client, tokenizer, MESSAGES, tools=TOOLS, body_tools=body_tools, **fields
    )
    choice = answer["choices"][0]
    ids, _ = sampled(answer)
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == tokenizer.decode(ids[:-1])
    assert choice["finish_reason"] == "stop"
    if not fields:  # the model called (a grammar under "none" forbids it)
        assert choice["message"]["content"].startswith("<tool_call>\n{")


async def test_a_tool_parser_reports_only_offered_functions(serve: Serve, tokenizer: Any) -> None:
    """parse_base_json drops a call of a function the request does not list;
    with none left, the text before the calls is the content."""
    client, _ = await serve(tool_call_parser="qwen25")
    prompt = render(tokenizer, ASK_ALL, tools=TOOLS, add_generation_prompt=True)
    body = {"messages": ASK_ALL, "input_ids": prompt, "seed": 4}
    both = await chat(client, {**body, "tools": TOOLS})
    assert [c["function"]["name"] for c in both["choices"][0]["message"]["tool_calls"]] == [
        "read_file",
        "list_dir",
    ]
    second = await chat(client, {**body, "tools": TOOLS[1:]})
    [call] = second["choices"][0]["message"]["tool_calls"]
    assert (call["function"]["name"], call["index"]) == ("list_dir", 0)
    assert second["choices"][0]["finish_reason"] == "tool_calls"
    other = {"type": "function", "function": {"name": "search", "parameters": {}}}
    neither = await chat(client, {**body, "tools": [other]})
    assert neither["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert neither["choices"][0]["finish_reason"] == "stop"


async def test_without_a_reasoning_parser_the_think_block_stays_in_the_content(
    serve: Serve, tokenizer: Any
) -> None:
    client, _ = await serve(**THINKING)
    answer, text = await _both(client, tokenizer, MESSAGES, template=QWEN3)
    message = answer["choices"][0]["message"]
    assert message == {"role": "assistant", "content": text}
    assert text.startswith("<think>\n") and "</think>" in text


@pytest.mark.parametrize(
    ("fields", "split"),
    [({}, True), ({"separate_reasoning": True}, True), ({"separate_reasoning": False}, False)],
    ids=["default", "separate", "not-separated"],
)
async def test_a_reasoning_parser_splits_only_with_separate_reasoning(
    serve: Serve, tokenizer: Any, fields: dict[str, Any], split: bool
) -> None:
    client, _ = await serve(**THINKING, reasoning_parser="qwen3")
    answer, text = await _both(client, tokenizer, MESSAGES, template=QWEN3, **fields)
    message = answer["choices"][0]["message"]
    if split:
        assert message["reasoning_content"] and message["content"]
        assert text == f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
    else:
        assert message == {"role": "assistant", "content": text}


async def test_separate_reasoning_is_read_as_pydantic_reads_it(serve: Serve) -> None:
    client, _ = await serve(reasoning_parser="qwen3")
    refused = await client.post(
        "/v1/chat/completions", json={"input_ids": [1, 2, 3], "separate_reasoning": "maybe"}
    )
    assert refused.status_code == 400
    body = refused.json()
    assert set(body) == FLAT_ERROR_KEYS and body["type"] == "Bad Request"
    assert body["message"].startswith("separate_reasoning: Input should be a valid boolean")


@pytest.mark.parametrize(
    "parsers",
    [
        {"reasoning_parser": "qwen3"},
        {"reasoning_parser": "qwen3", "tool_call_parser": "qwen25"},
    ],
    ids=["reasoning-parser-only", "both-parsers"],
)
async def test_a_reasoning_tool_call_answer(
    serve: Serve, tokenizer: Any, parsers: dict[str, Any]
) -> None:
    """Reasoning split first; the calls parsed from the rest only with a
    tool-call parser, else the rest (from the call on) is the content."""
    client, _ = await serve(**THINKING, **parsers)
    answer, text = await _both(client, tokenizer, MESSAGES, template=QWEN3, tools=TOOLS)
    choice = answer["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] and message["reasoning_content"] in text
    if "tool_call_parser" in parsers:
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["read_file"]
        assert message["content"] == "" and choice["finish_reason"] == "tool_calls"
    else:
        assert "tool_calls" not in message and choice["finish_reason"] == "stop"
        assert message["content"].startswith("<tool_call>\n{")
        assert text.endswith(message["content"])


@pytest.mark.parametrize(
    ("parsers", "fields"),
    [
        ({"tool_call_parser": "qwen25"}, {}),
        (
            {"tool_call_parser": "qwen25", "reasoning_parser": "qwen3"},
            {"separate_reasoning": False},
        ),
    ],
    ids=["no-reasoning-parser", "not-separated"],
)
async def test_calls_in_unseparated_reasoning_answers_are_not_modelled(
    serve: Serve, tokenizer: Any, parsers: dict[str, Any], fields: dict[str, Any]
) -> None:
    """A tool-call parser given the reasoning block too keeps it in its
    normal text, detector by detector: refused, never guessed."""
    client, emulator = await serve(**THINKING, **parsers)
    prompt = render(
        tokenizer, MESSAGES, tools=TOOLS, chat_template=QWEN3, add_generation_prompt=True
    )
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "tools": TOOLS, "input_ids": prompt, **fields},
    )
    assert response.status_code == 400
    assert response.json()["message"].startswith(
        "the emulator does not model a tool-call parser reading an answer whose reasoning"
    )
    assert emulator.prompt_tokens == 0  # refused before it ran


@pytest.mark.parametrize("parser", [None, "qwen3"], ids=["no-reasoning-parser", "qwen3"])
async def test_reasoning_tokens_are_counted_with_a_reasoning_parser(
    serve: Serve, tokenizer: Any, parser: str | None
) -> None:
    """The scheduler counts reasoning tokens with the reasoning parser's
    think-end ids (scheduler.py init_tokenizer): none without one."""
    client, _ = await serve(**THINKING, reasoning_parser=parser)
    answer, _ = await _both(client, tokenizer, MESSAGES, template=QWEN3, separate_reasoning=False)
    prompt = render(tokenizer, MESSAGES, chat_template=QWEN3, add_generation_prompt=True)
    sampling = {"sampling_seed": 4, "max_new_tokens": None}
    by_generate = await generate(client, {"input_ids": prompt, "sampling_params": sampling})
    counted = [
        answer["choices"][0]["meta_info"]["reasoning_tokens"],
        answer["usage"]["reasoning_tokens"],
        by_generate["meta_info"]["reasoning_tokens"],
    ]
    if parser is None:
        assert counted == [0, 0, 0]
    else:
        assert counted[0] == counted[1] == counted[2] > 0


async def test_kimi_k2_ids_count_the_requests_earlier_calls(serve: Serve, tokenizer: Any) -> None:
    """serving_chat._process_tool_call_id: with kimi_k2, functions.NAME:IDX,
    IDX after the tool calls of the request's assistant messages (the
    parser's rule, whatever the template: the emulator does not check the
    pairing, and the bundled Kimi template writes no calls)."""
    client, _ = await serve(tool_call_parser="kimi_k2")
    earlier = [
        {"id": f"functions.list_dir:{i}", "type": "function",
         "function": {"name": "list_dir", "arguments": {}}}
        for i in range(2)
    ]  # fmt: skip
    messages: list[dict[str, Any]] = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": earlier},
        {"role": "tool", "tool_call_id": "functions.list_dir:0", "content": "a.py"},
        {"role": "tool", "tool_call_id": "functions.list_dir:1", "content": "b.py"},
        {"role": "user", "content": "Now read them."},
    ]
    answer, _ = await _both(client, tokenizer, messages, tools=TOOLS)
    [call] = answer["choices"][0]["message"]["tool_calls"]
    assert call["id"] == "functions.read_file:2"
    first, _ = await _both(client, tokenizer, MESSAGES, tools=TOOLS)
    assert first["choices"][0]["message"]["tool_calls"][0]["id"] == "functions.read_file:0"


async def test_the_parse_routes_take_the_parser_from_the_body(serve: Serve, tokenizer: Any) -> None:
    """A worker without parsers still parses on /parse_function_call and
    /separate_reasoning: their parser is the request's."""
    client, _ = await serve(**THINKING)
    answer, _ = await _both(client, tokenizer, MESSAGES, template=QWEN3)
    text = tokenizer.decode(sampled(answer)[0][:-1], skip_special_tokens=True)
    split = await client.post(
        "/separate_reasoning", json={"text": text, "reasoning_parser": "qwen3"}
    )
    assert split.status_code == 200 and split.json()["reasoning_text"]
    calls = await client.post(
        "/parse_function_call", json={"text": text, "tools": TOOLS, "tool_call_parser": "qwen25"}
    )
    assert calls.status_code == 200 and calls.json()["calls"] == []
