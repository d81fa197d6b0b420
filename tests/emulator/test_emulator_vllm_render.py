"""The vLLM emulator's ``POST /v1/chat/completions/render`` over real sockets:
its ``GenerateRequest`` answer field by field (the prompt its template
renders, ``sampling_params`` as msgspec serialises them, the parse context),
every refusal in vLLM's shapes, the emulator's structural tag for each case
vLLM's parsers would constrain, and ``/inference/v1/generate`` sampling
under that tag (and refusing any other) (docs/emulator.md, vLLM mode)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest

from rollout_session.emulator.vllm.tag import TAG_FORMAT, read_tag
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import MESSAGES, NOPE, render
from tests.emulator.test_emulator import TOOLS as TOOLS_LITERAL
from tests.emulator.test_emulator_vllm import (
    ASK_ALL,
    GENERATE,
    NAMED,
    QWEN3,
    VLLM,
    contract_body,
    error_of,
    generate,
    tool_json_schema,
)
from tests.families import template_text

RENDER = "/v1/chat/completions/render"
TOOLS: list[dict[str, Any]] = copy.deepcopy(TOOLS_LITERAL)
HERMES: dict[str, Any] = {**VLLM, "tool_call_parser": "hermes"}
# TP GenerateRequest's fields, in declaration order (model_dump keeps it).
GENERATE_REQUEST_KEYS = [
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
    "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
    "parse_context", "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params",
    "ec_transfer_params",
]  # fmt: skip
PARSE_CONTEXT_KEYS = [
    "tools", "tool_choice", "parallel_tool_calls", "include_reasoning", "chat_template_kwargs",
    "history_tool_call_cnt",
]  # fmt: skip
# The chat route's defaults as msgspec's omit_defaults keeps them: the
# resolved floats are new objects (kept), stop/stop_token_ids/bad_words are
# [] where the default is None, output_kind FINAL_ONLY, skip_clone, and
# __post_init__'s skip_reading_prefix_cache False.
FLOATS = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "temperature": 1.0, "top_p": 1.0, "min_p": 0.0,
}  # fmt: skip
CTK = {"add_generation_prompt": True, "continue_final_message": False}
NO_OUTPUTS = {
    "json": None, "regex": None, "choice": None, "grammar": None, "json_object": None,
    "disable_any_whitespace": False, "disable_additional_properties": False,
    "whitespace_pattern": None, "structural_tag": None,
}  # fmt: skip
STRICT_TOOLS: list[dict[str, Any]] = copy.deepcopy(TOOLS)
STRICT_TOOLS[0]["function"]["strict"] = True
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'},
}
AFTER_TOOL: list[dict[str, Any]] = [
    *MESSAGES,
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "the file"},
]


def dumped(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ChatCompletionToolsParam.model_dump(): description and parameters always there."""
    out = []
    for tool in tools:
        function = tool["function"]
        dump = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            dump["strict"] = function["strict"]
        out.append({"type": "function", "function": dump})
    return out


async def rendered(
    client: httpx.AsyncClient, body: dict[str, Any], **headers: str
) -> dict[str, Any]:
    response = await client.post(RENDER, json=body, headers=headers)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def tag(
    choice: Any,
    *,
    tools: tuple[str, ...] = ("read_file", "list_dir"),
    parser: str = "hermes",
    strict: tuple[str, ...] = (),
    single: bool = False,
    response_format: Any = None,
) -> dict[str, Any]:
    """The structured outputs holding the emulator's tag (its documented format)."""
    document = {
        "type": "structural_tag",
        "format": {
            "type": "rollout_session_emulator_tool_calls",
            "parser": parser,
            "tools": list(tools),
            "tool_choice": choice,
            "strict": list(strict),
            "stop_after_first": single,
            "response_format": response_format,
        },
    }
    return {**NO_OUTPUTS, "structural_tag": json.dumps(document)}


# -- the answer ------------------------------------------------------------------


async def test_render_answers_a_generate_request(serve: Serve, tokenizer: Any) -> None:
    client, emulator = await serve(**VLLM)
    answer = await rendered(client, {"messages": MESSAGES})
    assert list(answer) == GENERATE_REQUEST_KEYS
    assert answer["request_id"].startswith("chatcmpl-") and len(answer["request_id"]) == 9 + 16
    assert answer["token_ids"] == render(tokenizer, MESSAGES, add_generation_prompt=True)
    room = 32768 - len(answer["token_ids"])
    assert answer["sampling_params"] == {
        **FLOATS, "stop": [], "stop_token_ids": [], "max_tokens": room, "output_kind": 2,
        "skip_clone": True, "bad_words": [], "skip_reading_prefix_cache": False,
    }  # fmt: skip
    assert list(answer["sampling_params"])[:6] == list(FLOATS)
    assert answer["output_mode"] == "tokens"
    assert answer["parse_context"] == {
        "tools": None, "tool_choice": "none", "parallel_tool_calls": True,
        "include_reasoning": True, "chat_template_kwargs": CTK, "history_tool_call_cnt": 0,
    }  # fmt: skip
    assert list(answer["parse_context"]) == PARSE_CONTEXT_KEYS
    for key in ("token_offsets", "features", "content_parts", "model", "reasoning_ended"):
        assert answer[key] is None, key
    for key in ("reasoning_parser_kwargs", "return_token_ids", "stream_options", "cache_salt"):
        assert answer[key] is None, key
    assert (answer["stream"], answer["priority"]) == (False, 0)
    assert answer["kv_transfer_params"] is None and answer["ec_transfer_params"] is None
    record = emulator.requests[-1]
    assert (record.route, record.body) == ("vllm-render", {"messages": MESSAGES})
    assert emulator.received == emulator.completed == 1 and emulator.prompt_tokens == 0


async def test_render_ids_model_and_tools(serve: Serve, tokenizer: Any) -> None:
    """The template renders the tools as vLLM dumps them (``description``
    null where absent); ``model`` is the request's; X-Request-Id wins."""
    client, _ = await serve(**HERMES)
    body = {
        "messages": AFTER_TOOL,
        "tools": TOOLS,
        "model": "rollout-session/emulator",
        "request_id": "abc",
    }
    answer = await rendered(client, body)
    assert answer["request_id"] == "chatcmpl-abc"
    assert answer["model"] == "rollout-session/emulator"
    history = [*AFTER_TOOL[:2], {**AFTER_TOOL[2], "tool_calls": [json.loads(json.dumps(CALL))]}]
    history[2]["tool_calls"][0]["function"]["arguments"] = {"path": "a.txt"}
    expected = render(
        tokenizer, [*history, AFTER_TOOL[3]], add_generation_prompt=True, tools=dumped(TOOLS)
    )
    assert answer["token_ids"] == expected
    assert '"description": null' in tokenizer.decode(expected)
    context = answer["parse_context"]
    assert context["tools"] == dumped(TOOLS)
    assert (context["tool_choice"], context["history_tool_call_cnt"]) == ("auto", 1)
    # Hermes2ProToolParser.adjust_request: special tokens kept for tool requests.
    assert answer["sampling_params"]["skip_special_tokens"] is False
    by_header = await rendered(client, body, **{"X-Request-Id": "hdr-2"})
    assert by_header["request_id"] == "chatcmpl-hdr-2"
    plain = await rendered(client, {"messages": MESSAGES})
    assert "skip_special_tokens" not in plain["sampling_params"]


async def test_render_sampling_params_as_msgspec_writes_them(serve: Serve) -> None:
    client, _ = await serve(**VLLM)
    body = {
        "messages": MESSAGES, "temperature": 0, "top_p": 0.5, "seed": 7, "stop": ["xx", "yyy"],
        "stop_token_ids": [5, 5, 6], "logprobs": True, "logit_bias": {"5": 200},
        "max_tokens": 16, "min_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
        "skip_special_tokens": False, "routed_experts_prompt_start": 3, "priority": 4,
        "return_token_ids": True, "cache_salt": "salt",
    }  # fmt: skip
    answer = await rendered(client, body)
    sampling = answer["sampling_params"]
    # Greedy resets top_p; max_tokens 16 is the default object: omitted.
    assert sampling == {
        **FLOATS, "temperature": 0.0, "seed": 7, "stop": ["xx", "yyy"], "stop_token_ids": [5, 6],
        "ignore_eos": True, "min_tokens": 2, "logprobs": 0, "skip_special_tokens": False,
        "output_kind": 1, "skip_clone": True, "output_text_buffer_length": 2,
        "logit_bias": {"5": 100.0}, "bad_words": [], "skip_reading_prefix_cache": False,
        "routed_experts_prompt_start": 3,
    }  # fmt: skip
    assert list(sampling) == [
        "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
        "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs",
        "skip_special_tokens", "output_kind", "skip_clone", "output_text_buffer_length",
        "logit_bias", "bad_words", "skip_reading_prefix_cache", "routed_experts_prompt_start",
    ]  # fmt: skip
    assert answer["stream"] is True
    assert answer["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert (answer["priority"], answer["return_token_ids"], answer["cache_salt"]) == (
        4,
        True,
        "salt",
    )
    capped = await rendered(client, {"messages": MESSAGES, "max_completion_tokens": 9})
    assert capped["sampling_params"]["max_tokens"] == 9


@pytest.mark.parametrize(
    ("overrides", "messages", "body", "ended"),
    [
        ({}, MESSAGES, {}, None),
        ({"reasoning_parser": "qwen3"}, MESSAGES, {}, False),
        ({"reasoning_parser": "qwen3"}, MESSAGES, {"include_reasoning": False}, True),
        (
            {"reasoning_parser": "qwen3", "chat_template": QWEN3},
            MESSAGES,
            {"chat_template_kwargs": {"enable_thinking": False}},
            True,
        ),
        # A closed think block in this turn's history: the engine parser stops
        # at the turn boundary, the basic one finds the block.
        ({"reasoning_parser": "qwen3", "chat_template": QWEN3}, "thought", {}, False),
        ({"reasoning_parser": "deepseek_r1", "chat_template": QWEN3}, "thought", {}, True),
        ({"reasoning_parser": "deepseek_v3"}, MESSAGES, {}, True),
        (
            {"reasoning_parser": "deepseek_v3"},
            MESSAGES,
            {"chat_template_kwargs": {"thinking": True}},
            False,
        ),
        ({"reasoning_parser": "glm45"}, MESSAGES, {}, False),
    ],
    ids=[
        "no-parser", "qwen3-thinking", "include-reasoning-false", "qwen3-thinking-off",
        "qwen3-history-think", "deepseek-r1-history-think", "deepseek-v3-identity",
        "deepseek-v3-thinking", "glm45-thinking",
    ],
)  # fmt: skip
async def test_render_reasoning_ended(
    serve: Serve,
    tokenizer: Any,
    overrides: dict[str, Any],
    messages: Any,
    body: dict[str, Any],
    ended: Any,
) -> None:
    client, _ = await serve(**VLLM, **overrides)
    if messages == "thought":
        thinking = {**AFTER_TOOL[2], "reasoning_content": "I should read it."}
        messages = [*AFTER_TOOL[:2], thinking, AFTER_TOOL[3]]
    answer = await rendered(client, {"messages": messages, **body})
    assert answer["reasoning_ended"] is ended
    kwargs = answer["reasoning_parser_kwargs"]
    if "reasoning_parser" in overrides:
        assert kwargs == {"chat_template_kwargs": {**body.get("chat_template_kwargs", {}), **CTK}}
        assert answer["parse_context"]["chat_template_kwargs"] == kwargs["chat_template_kwargs"]
    else:
        assert kwargs is None
    if messages is not MESSAGES:  # the history's think block is in the prompt
        assert "I should read it.\n</think>" in tokenizer.decode(answer["token_ids"])


async def test_render_prompt_at_the_context_is_refused_by_sampling_params(
    serve: Serve, tokenizer: Any
) -> None:
    """A prompt exactly at the context leaves max_tokens 0 (get_max_tokens):
    SamplingParams refuses it."""
    length = len(render(tokenizer, MESSAGES, add_generation_prompt=True))
    client, _ = await serve(**VLLM, context_length=length)
    error = error_of(await client.post(RENDER, json={"messages": MESSAGES}), 400, "BadRequestError")
    assert (error["message"], error["param"]) == (
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        "max_tokens",
    )


# -- refusals ------------------------------------------------------------------------

LONG = [{"role": "user", "content": "word " * 200}]
IMAGE = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
NAMED_NO_NAME = {"type": "function", "function": {}}
MISTRAL = template_text("mistral-nemo")

# (config overrides, body, status, type, param, message or its start)
RENDER_REFUSALS: dict[str, tuple[dict[str, Any], Any, int, str, str | None, str]] = {
    "no-messages": (
        {}, {}, 400, "Bad Request", "body.messages",
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field "
        "required', 'input': '<dict of 0 items>'}",
    ),
    "messages-not-a-list": (
        {}, {"messages": "hi"}, 400, "Bad Request", "body.messages",
        "1 validation error:\n  {'type': 'list_type', 'loc': 'body.messages'",
    ),
    "temperature-type": (
        {}, {"messages": MESSAGES, "temperature": "hot"}, 400, "Bad Request",
        "body.temperature", "1 validation error:\n  {'type': 'float_parsing'",
    ),
    "unknown-model": (
        {}, {"messages": MESSAGES, "model": "other"}, 404, "NotFoundError", "model",
        "The model `other` does not exist. Valid aliases: rollout-session/emulator.",
    ),
    "empty-tools": (
        HERMES, {"messages": MESSAGES, "tools": []}, 400, "BadRequestError", "tools",
        "`tools` must not be an empty array. Either provide at least one tool or omit the "
        "field entirely. (parameter=tools)",
    ),
    "tool-choice-without-tools": (
        HERMES, {"messages": MESSAGES, "tool_choice": "required"}, 400, "BadRequestError",
        "tool_choice", "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
    ),
    "bad-tool-choice": (
        HERMES, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "any"}, 400,
        "BadRequestError", "tool_choice",
        'Invalid value for `tool_choice`: any! Only named tools, "none", "auto" or "required" '
        "are supported. (parameter=tool_choice)",
    ),
    "named-tool-not-in-tools": (
        HERMES, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NOPE}, 400,
        "BadRequestError", "tool_choice",
        "The tool specified in `tool_choice` does not match any of the specified `tools` "
        "(parameter=tool_choice)",
    ),
    "named-without-name": (
        HERMES, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED_NO_NAME}, 400,
        "BadRequestError", "tool_choice.function.name",
        'Expected field `name` in `function` in `tool_choice`! Correct usage: `{"type": '
        '"function", "function": {"name": "my_function"}}` (parameter=tool_choice.function.name)',
    ),
    "auto-without-tool-parser": (
        {}, {"messages": MESSAGES, "tools": TOOLS}, 400, "BadRequestError", None,
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
    ),
    "required-without-tool-parser": (
        {}, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}, 400,
        "BadRequestError", None, 'tool_choice="required" requires --tool-call-parser to be set',
    ),
    "named-without-tool-parser": (
        {}, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED}, 400,
        "BadRequestError", None,
        'tool_choice=function "list_dir" requires --tool-call-parser to be set',
    ),
    "max-tokens-over-context": (
        {}, {"messages": MESSAGES, "max_tokens": 40000}, 400, "BadRequestError", "max_tokens",
        "max_tokens=40000 cannot be greater than max_model_len=32768. Please request fewer "
        "output tokens. (parameter=max_tokens, value=40000)",
    ),
    "max-completion-tokens-over-context": (
        {}, {"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 40000}, 400,
        "BadRequestError", "max_completion_tokens",
        "max_completion_tokens=40000 cannot be greater than max_model_len=32768.",
    ),
    "beam-search": (
        {}, {"messages": MESSAGES, "use_beam_search": True}, 400, "BadRequestError", None,
        "Beam search is not supported by the render endpoint",
    ),
    "continue-and-generation-prompt": (
        {}, {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
        400, "BadRequestError", None,
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
    ),
    "stream-options-without-stream": (
        {}, {"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400,
        "BadRequestError", "stream_options",
        "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
    ),
    "json-schema-without-schema": (
        {}, {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400,
        "BadRequestError", "response_format",
        "When response_format type is 'json_schema', the 'json_schema' field must be provided. "
        "(parameter=response_format)",
    ),
    "structured-outputs-and-named-tool": (
        HERMES,
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED,
         "structured_outputs": {"json": SCHEMA}},
        400, "BadRequestError", None,
        "You can only either use constraints for structured outputs or tools, not both.",
    ),
    "two-structured-outputs": (
        {}, {"messages": MESSAGES, "structured_outputs": {"json": SCHEMA, "regex": "a"}}, 400,
        "BadRequestError", None,
        "You can only use one kind of constraints for structured outputs ('json', 'regex' or "
        "'choice').",
    ),
    "top-logprobs-without-logprobs": (
        {}, {"messages": MESSAGES, "top_logprobs": 2}, 400, "BadRequestError", "top_logprobs",
        "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
    ),
    "request-chat-template": (
        {}, {"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "BadRequestError",
        None,
        "Chat template is passed with request, but --trust-request-chat-template is not set. "
        "Refused request with untrusted chat template.",
    ),
    "mm-processor-kwargs": (
        {}, {"messages": MESSAGES, "mm_processor_kwargs": {"a": 1}}, 400, "BadRequestError",
        "mm_processor_kwargs",
        "Per-request mm_processor_kwargs are disabled by default because they can change "
        "multimodal preprocessing resource usage.",
    ),
    "cache-salt": (
        {}, {"messages": MESSAGES, "cache_salt": "a/b"}, 400, "BadRequestError", "cache_salt",
        "Parameter 'cache_salt' must be at most 128 characters",
    ),
    "prompt-over-context": (
        {"context_length": 64}, {"messages": LONG}, 400, "BadRequestError", "input_tokens",
        "This model's maximum context length is 64 tokens. However, your prompt contains at "
        "least 65 input tokens, which exceeds this limit even without any output tokens. Please "
        "reduce the length of the input prompt. (parameter=input_tokens, value=65)",
    ),
    "template-refuses": (
        {"chat_template": MISTRAL},
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        400, "BadRequestError", None,
        "After the optional system message, conversation roles must alternate "
        "user/assistant/user/assistant/...",
    ),
    "temperature-over-2": (
        {}, {"messages": MESSAGES, "temperature": 2.5}, 400, "BadRequestError", "temperature",
        "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",
    ),
    "logit-bias-key": (
        {}, {"messages": MESSAGES, "logit_bias": {"x": 1}}, 400, "BadRequestError",
        "logit_bias",
        "logit_bias contains key(s) that cannot be converted to integer token IDs: ['x'] "
        "(parameter=logit_bias, value=['x'])",
    ),
    # What vLLM renders and the emulator does not model.
    "regex-not-modelled": (
        {}, {"messages": MESSAGES, "structured_outputs": {"regex": "a+"}}, 400,
        "BadRequestError", "structured_outputs",
        "the emulator does not model structured_outputs.regex on /v1/chat/completions/render",
    ),
    "reasoning-effort-not-modelled": (
        {}, {"messages": MESSAGES, "reasoning_effort": "low"}, 400, "BadRequestError",
        "reasoning_effort", "the emulator does not model reasoning_effort",
    ),
    "image-not-modelled": (
        {}, {"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "BadRequestError",
        "messages", "the emulator does not model content parts other than text (messages[0])",
    ),
    "developer-role-not-modelled": (
        {}, {"messages": [{"role": "developer", "content": "x"}]}, 400, "BadRequestError",
        "messages", "the emulator does not model messages[0]: it renders messages of role",
    ),
    "tool-parser-not-modelled": (
        {**VLLM, "tool_call_parser": "mistral"}, {"messages": MESSAGES, "tools": TOOLS}, 400,
        "BadRequestError", None,
        "the emulator does not model /v1/chat/completions/render with --tool-call-parser "
        "mistral",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RENDER_REFUSALS.values()), ids=list(RENDER_REFUSALS))
async def test_render_refusals_in_vllm_shapes(
    serve: Serve, case: tuple[dict[str, Any], Any, int, str, str | None, str]
) -> None:
    overrides, body, status, type_, param, message = case
    client, emulator = await serve(**{**VLLM, **overrides})
    error = error_of(await client.post(RENDER, json=body), status, type_)
    assert error["message"].startswith(message), error["message"]
    assert error["param"] == param
    assert emulator.received == emulator.completed == 1


async def test_render_wants_json(serve: Serve) -> None:
    client, _ = await serve(**VLLM)
    response = await client.post(RENDER, content=b"{}", headers={"content-type": "text/plain"})
    assert error_of(response, 400, "Bad Request")["message"] == (
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    )


# -- the constraint: the emulator's tag, vLLM's JSON schema, response formats ----------

REQUIRED_SCHEMA = tool_json_schema("required")  # tool_parsers/utils.py

# (parser, request fields beside messages, structured_outputs in the answer)
CONSTRAINTS: dict[str, tuple[str | None, dict[str, Any], Any]] = {
    "plain-auto": ("hermes", {"tools": TOOLS}, None),
    "required": ("hermes", {"tools": TOOLS, "tool_choice": "required"}, tag("required")),
    "named": ("hermes", {"tools": TOOLS, "tool_choice": NAMED}, tag({"name": "list_dir"})),
    "auto-strict-tool": (
        "hermes", {"tools": STRICT_TOOLS}, tag("auto", strict=("read_file",)),
    ),
    "auto-single-call": (
        "hermes", {"tools": TOOLS, "parallel_tool_calls": False}, tag("auto", single=True),
    ),
    "required-single-call": (
        "hermes", {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        tag("required", single=True),
    ),
    "auto-strict-and-json-schema": (
        "hermes", {"tools": STRICT_TOOLS, "response_format": JSON_SCHEMA},
        tag("auto", strict=("read_file",), response_format={"json": SCHEMA}),
    ),
    "auto-strict-and-json-object-single": (
        "hermes",
        {"tools": STRICT_TOOLS, "response_format": {"type": "json_object"},
         "parallel_tool_calls": False},
        tag("auto", strict=("read_file",), single=True, response_format={"json_object": True}),
    ),
    # No tag: "auto" keeps its format-only constraint (parallel_tool_calls
    # false does not raise the level with a structured output).
    "auto-and-json-object": (
        "hermes", {"tools": TOOLS, "response_format": {"type": "json_object"},
                   "parallel_tool_calls": False},
        {**NO_OUTPUTS, "json_object": True},
    ),
    "required-drops-response-format": (
        "hermes", {"tools": TOOLS, "tool_choice": "required", "response_format": JSON_SCHEMA},
        tag("required"),
    ),
    "tool-choice-none": ("hermes", {"tools": TOOLS, "tool_choice": "none"}, None),
    "no-tools-json-schema": (
        "hermes", {"response_format": JSON_SCHEMA}, {**NO_OUTPUTS, "json": SCHEMA},
    ),
    "glm45-auto": ("glm45", {"tools": TOOLS}, tag("auto", parser="glm45")),
    "glm45-none": ("glm45", {"tools": TOOLS, "tool_choice": "none"}, None),
    "kimi-k2-named": (
        "kimi_k2", {"tools": TOOLS, "tool_choice": NAMED},
        tag({"name": "list_dir"}, parser="kimi_k2"),
    ),
    # Parsers without a structural tag: ToolParser.adjust_request's JSON schema.
    "pythonic-required": (
        "pythonic", {"tools": TOOLS, "tool_choice": "required"},
        {**NO_OUTPUTS, "json": REQUIRED_SCHEMA},
    ),
    "pythonic-named": (
        "pythonic", {"tools": TOOLS, "tool_choice": NAMED},
        {**NO_OUTPUTS, "json": TOOLS[1]["function"]["parameters"]},
    ),
    "pythonic-auto": ("pythonic", {"tools": TOOLS}, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONSTRAINTS.values()), ids=list(CONSTRAINTS))
async def test_render_constraint_for_each_case(
    serve: Serve, case: tuple[str | None, dict[str, Any], Any]
) -> None:
    parser, fields, expected = case
    client, _ = await serve(**VLLM, tool_call_parser=parser)
    answer = await rendered(client, {"messages": MESSAGES, **fields})
    sampling = answer["sampling_params"]
    assert sampling.get("structured_outputs") == expected
    if expected is not None and expected["structural_tag"] is not None:
        assert list(sampling["structured_outputs"]) == list(NO_OUTPUTS)
        parsed = read_tag(expected["structural_tag"])
        assert parsed is not None and parsed.parser == parser


async def test_required_schema_hoists_the_tools_defs(serve: Serve) -> None:
    """get_json_schema_from_tools pops each tool's ``$defs`` into the
    schema's (the tools in parse_context lose them too)."""
    client, _ = await serve(**VLLM, tool_call_parser="pythonic")
    tools = copy.deepcopy(TOOLS)
    tools[0]["function"]["parameters"]["$defs"] = {"Mode": {"type": "string"}}
    answer = await rendered(
        client, {"messages": MESSAGES, "tools": tools, "tool_choice": "required"}
    )
    schema = answer["sampling_params"]["structured_outputs"]["json"]
    assert schema["$defs"] == {"Mode": {"type": "string"}}
    assert (
        schema["items"]["anyOf"][0]["properties"]["parameters"]
        == TOOLS[0]["function"]["parameters"]
    )
    assert "$defs" not in answer["parse_context"]["tools"][0]["function"]["parameters"]


# -- /inference/v1/generate under the render's constraint ------------------------------


async def render_then_generate(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the session server's vllm engine does: the constraint from
    render, sent unchanged on /inference/v1/generate (derender)."""
    answer = await rendered(client, body)
    sampling = answer["sampling_params"]
    generate_body = contract_body(
        answer["token_ids"],
        sampling={
            "structured_outputs": sampling.get("structured_outputs"),
            "skip_special_tokens": sampling.get("skip_special_tokens", True),
        },
        parse_context=answer["parse_context"],
    )
    [choice] = (await generate(client, generate_body))["choices"]
    return answer, choice


def called(choice: dict[str, Any]) -> list[str]:
    return [c["function"]["name"] for c in choice["message"].get("tool_calls", [])]


# (messages, request fields, calls sampled, content, finish_reason)
UNDER_TAGS: dict[str, tuple[Any, dict[str, Any], list[str], Any, str]] = {
    # A named function: that call, finish "stop" (no tool_calls rewrite).
    "named": (MESSAGES, {"tool_choice": NAMED}, ["list_dir"], "", "stop"),
    # After a tool result the model answers in text; "required" makes it call.
    "required": (AFTER_TOOL, {"tool_choice": "required"}, ["read_file"], "", "tool_calls"),
    "auto-after-tool": (AFTER_TOOL, {}, [], "text", "stop"),
    "required-all-tools": (ASK_ALL, {"tool_choice": "required"}, ["read_file", "list_dir"], "",
                           "tool_calls"),
    "stop-after-first": (
        ASK_ALL, {"tool_choice": "required", "parallel_tool_calls": False}, ["read_file"], "",
        "tool_calls",
    ),
    "auto-stop-after-first": (ASK_ALL, {"parallel_tool_calls": False}, ["read_file"], None,
                              "tool_calls"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(UNDER_TAGS.values()), ids=list(UNDER_TAGS))
async def test_generate_samples_under_the_tag(
    serve: Serve, case: tuple[Any, dict[str, Any], list[str], Any, str]
) -> None:
    messages, fields, calls, content, finish = case
    client, emulator = await serve(**HERMES)
    answer, choice = await render_then_generate(
        client, {"messages": messages, "tools": TOOLS, **fields}
    )
    if fields:
        assert "structural_tag" in answer["sampling_params"]["structured_outputs"]
    assert called(choice) == calls
    if content == "text":
        assert choice["message"]["content"]
    else:
        assert choice["message"]["content"] == content
    assert choice["finish_reason"] == finish
    assert [r.route for r in emulator.requests] == ["vllm-render", "vllm-generate"]


async def test_auto_tag_with_a_response_format_samples_as_auto(serve: Serve) -> None:
    """An "auto" tag (a strict tool) with a response format folded in: the
    model answers as it would unconstrained (it has no JSON mode)."""
    client, _ = await serve(**HERMES)
    for messages in (MESSAGES, AFTER_TOOL):
        body = {"messages": messages, "tools": STRICT_TOOLS, "response_format": JSON_SCHEMA}
        answer, constrained = await render_then_generate(client, body)
        document = json.loads(answer["sampling_params"]["structured_outputs"]["structural_tag"])
        assert document["format"]["response_format"] == {"json": SCHEMA}
        plain = contract_body(
            answer["token_ids"],
            sampling={"skip_special_tokens": False},
            parse_context=answer["parse_context"],
        )
        [free] = (await generate(client, plain))["choices"]
        assert constrained["token_ids"] == free["token_ids"]
        assert constrained["message"] == free["message"]


async def test_named_tag_the_prompt_does_not_offer_is_refused(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(**HERMES)
    answer = await rendered(client, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED})
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True)  # no tools in it
    body = contract_body(
        prompt,
        sampling={"structured_outputs": answer["sampling_params"]["structured_outputs"]},
        parse_context=answer["parse_context"],
    )
    error = error_of(await client.post(GENERATE, json=body), 400, "BadRequestError")
    assert "does not offer" in error["message"]


XGRAMMAR_TAG = json.dumps(
    {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"],
                                          "tags": []}}
)  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "structural_tag", "message"),
    [
        (
            HERMES,
            XGRAMMAR_TAG,
            "the emulator does not model structured_outputs.structural_tag (only the tags its "
            "/v1/chat/completions/render mints; xgrammar's are not modelled)",
        ),
        (
            HERMES,
            tag("required", parser="kimi_k2")["structural_tag"],
            "the emulator does not model structured_outputs.structural_tag for tool parser "
            "'kimi_k2' on a server whose tool parser is 'hermes'",
        ),
        (
            VLLM,
            tag("required")["structural_tag"],
            "the emulator does not model structured_outputs.structural_tag for tool parser "
            "'hermes' on a server whose tool parser is None",
        ),
        (
            HERMES,
            tag("required")["structural_tag"].replace(TAG_FORMAT, "other_format"),
            "the emulator does not model structured_outputs.structural_tag (only the tags",
        ),
    ],
    ids=["xgrammar-tag", "other-parser", "no-tool-parser", "unknown-format"],
)
async def test_generate_refuses_tags_it_did_not_mint(
    serve: Serve, tokenizer: Any, overrides: dict[str, Any], structural_tag: str, message: str
) -> None:
    client, _ = await serve(**overrides)
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True, tools=TOOLS)
    body = contract_body(
        prompt,
        sampling={"structured_outputs": {"structural_tag": structural_tag}},
        parse_context={"tools": TOOLS, "tool_choice": "required"},
    )
    error = error_of(await client.post(GENERATE, json=body), 400, "BadRequestError")
    assert error["message"].startswith(message), error["message"]
    assert error["param"] == "structured_outputs"


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps({"type": "structural_tag"}),
        tag("required")["structural_tag"].replace('"required"', '"sometimes"'),
        tag({"name": "nope"})["structural_tag"],
        tag("required", response_format={"json": SCHEMA})["structural_tag"],
        tag("auto", response_format={"regex": "a"})["structural_tag"],
    ],
    ids=["not-json", "no-format", "bad-choice", "named-not-in-tools", "forced-with-format",
         "regex-format"],
)  # fmt: skip
def test_read_tag_takes_only_the_documented_shape(text: str) -> None:
    assert read_tag(text) is None


def test_read_tag_reads_what_render_mints() -> None:
    parsed = read_tag(
        tag({"name": "list_dir"}, single=True, strict=("read_file",))["structural_tag"]
    )
    assert parsed is not None
    assert (parsed.tool_choice, parsed.named, parsed.stop_after_first) == (
        "named",
        "list_dir",
        True,
    )
    assert (parsed.tools, parsed.strict) == (("read_file", "list_dir"), ("read_file",))
