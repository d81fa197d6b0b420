"""The emulator's native routes over real sockets, as SGLang 0.5.23 serves them:
``/generate`` (its contract gate, sampling defaults, text, logprobs, the tool
constraint read from ``json_schema``) samples what the chat route samples for
the same prompt ids, seed and budget; ``/parse_function_call`` and
``/separate_reasoning`` answer for the texts the emulator sampled and refuse
any other (docs/emulator.md)."""

from __future__ import annotations

import base64
import json
import types
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from rollout_session.emulator.model.prompt_reader import ALL_TOOLS
from rollout_session.emulator.sglang.contract_gate import SAMPLING_FIELDS, contract_error
from rollout_session.emulator.sglang.parse_memo import NOT_SAMPLED, ParseMemo
from rollout_session.emulator.tokenizer import builtin_template
from tests.emulator.conftest import Serve
from tests.emulator.test_emulator import (
    FLAT_ERROR_KEYS,
    MESSAGES,
    TOOLS,
    chat,
    encode,
    render,
    sampled,
)
from tests.sglang_source import load_api_types, or_skip

QWEN3 = builtin_template("qwen3")
ASK_ALL: list[dict[str, Any]] = [
    MESSAGES[0],
    {"role": "user", "content": f"List the files; {ALL_TOOLS}."},
]
CALL: dict[str, Any] = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "read_file", "arguments": {"path": "a.py"}},
}
AFTER_TOOL: list[dict[str, Any]] = [
    *MESSAGES,
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.py b.py"},
]
# The contract gate's unknown-field text (api/v1/api_types.py, _FIELDS_SamplingParams).
UNKNOWN_FOO = "unknown field `foo`, expected one of " + ", ".join(
    f"`{name}`" for name in SAMPLING_FIELDS
)


def _tool_schema(function: dict[str, Any]) -> dict[str, Any]:
    """srt/function_call/utils.py `_get_tool_schema`."""
    return {
        "properties": {
            "name": {"type": "string", "enum": [function["name"]]},
            "parameters": function.get("parameters") or {"type": "object", "properties": {}},
        },
        "required": ["name", "parameters"],
    }


def json_schema(tools: list[dict[str, Any]], choice: Any, parallel: bool = True) -> str:
    """srt/function_call/utils.py `get_json_schema_constraint`, serialised as
    `to_sampling_params` does (json.dumps)."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    if choice == "required":
        schema["items"] = {
            "type": "object",
            "anyOf": [_tool_schema(t["function"]) for t in tools],
        }
    else:
        [chosen] = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        schema["items"] = _tool_schema(chosen["function"])
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


async def generate(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def native_error(response: httpx.Response) -> str:
    """SGLang's native-route error: 400 {"error": {"message"}}."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message"}, body
    message: str = body["error"]["message"]
    return message


def gate_error(response: httpx.Response) -> str:
    """The contract gate's 400: {"error": "<text>"} (a plain string)."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    text: str = body["error"]
    return text


@dataclass(frozen=True)
class Case:
    """One prompt sent to both routes: chat fields and the /generate sampling
    fields SGLang's chat route would build from them, and the calls expected."""

    config: dict[str, Any]
    messages: list[Any]
    tools: list[Any] | None = None
    chat: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    called: tuple[str, ...] = ()


# The workers run the templates' SGLang parsers (the chat route parses only with them).
CHATML: dict[str, Any] = {"tool_call_parser": "qwen25"}
THINKING: dict[str, Any] = {
    **CHATML,
    "chat_template": QWEN3,
    "reasoning": True,
    "reasoning_parser": "qwen3",
}
NAMED = {"type": "function", "function": {"name": "list_dir"}}
PARITY: dict[str, Case] = {
    "qwen3-reasoning": Case(THINKING, MESSAGES),
    "qwen3-reasoning-cut": Case(THINKING, MESSAGES, None, {"max_tokens": 6}, {"max_new_tokens": 6}),
    "qwen3-tool-call": Case(THINKING, MESSAGES, TOOLS, called=("read_file",)),
    "chatml-text": Case(CHATML, MESSAGES, None, {"max_tokens": 40}, {"max_new_tokens": 40}),
    "chatml-tool-call": Case(CHATML, MESSAGES, TOOLS, called=("read_file",)),
    "chatml-parallel": Case(CHATML, ASK_ALL, TOOLS, called=("read_file", "list_dir")),
    "chatml-after-tool-result": Case(CHATML, AFTER_TOOL, TOOLS),
    "chatml-required-after-tool-result": Case(
        CHATML,
        AFTER_TOOL,
        TOOLS,
        {"tool_choice": "required"},
        {"json_schema": json_schema(TOOLS, "required")},
        ("read_file",),
    ),
    "chatml-required-one-call": Case(
        CHATML,
        ASK_ALL,
        TOOLS,
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"json_schema": json_schema(TOOLS, "required", parallel=False)},
        ("read_file",),
    ),
    "chatml-named": Case(
        CHATML,
        MESSAGES,
        TOOLS,
        {"tool_choice": NAMED},
        {"json_schema": json_schema(TOOLS, NAMED)},
        ("list_dir",),
    ),
}


@pytest.mark.parametrize("case", list(PARITY.values()), ids=list(PARITY))
async def test_generate_samples_what_chat_samples(serve: Serve, tokenizer: Any, case: Case) -> None:
    """Same prompt ids, seed and budget: the same ids, logprobs and counts
    (the model reads its prompt; the request's messages/tools never reach it)."""
    client, _ = await serve(**case.config)
    template = case.config.get("chat_template")
    prompt = render(
        tokenizer,
        case.messages,
        tools=case.tools,
        chat_template=template,
        add_generation_prompt=True,
    )
    body: dict[str, Any] = {
        "messages": case.messages,
        "input_ids": prompt,
        "seed": 9,
        **case.chat,
    }
    if case.tools:
        body["tools"] = case.tools
    by_chat = await chat(client, body)
    by_generate = await generate(
        client,
        {
            "input_ids": prompt,
            # Chat without max_tokens has no limit; /generate needs null for that.
            "sampling_params": {"sampling_seed": 9, "max_new_tokens": None, **case.sampling},
            "return_logprob": True,
        },
    )
    meta = by_chat["choices"][0]["meta_info"]
    gen_meta = by_generate["meta_info"]
    assert by_generate["output_ids"] == sampled(by_chat)[0]
    assert [e[0] for e in gen_meta["output_token_logprobs"]] == sampled(by_chat)[1]
    for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
        assert gen_meta[key] == meta[key], key
    message = by_chat["choices"][0]["message"]
    called = tuple(c["function"]["name"] for c in message.get("tool_calls") or ())
    assert called == case.called
    if called:
        # The chat route rewrites the finish reason of a parsed call; /generate does not.
        assert meta["finish_reason"] == {"type": "tool_calls", "matched": None}
        assert gen_meta["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
    else:
        assert gen_meta["finish_reason"] == meta["finish_reason"]
    if "max_tokens" in case.chat:
        assert len(by_generate["output_ids"]) <= case.chat["max_tokens"]
    assert (gen_meta["reasoning_tokens"] > 0) is bool(case.config.get("reasoning"))


async def test_generate_answer_has_sglang_meta_info(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(weight_version="w2")
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True)
    plain = await generate(client, {"input_ids": prompt, "rid": "g-1"})
    assert set(plain) == {"text", "output_ids", "meta_info"}
    assert list(plain["meta_info"]) == [
        "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
        "reasoning_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
    ]  # fmt: skip
    assert plain["meta_info"]["id"] == "g-1"
    assert plain["meta_info"]["weight_version"] == "w2"
    with_logprobs = await generate(
        client, {"input_ids": prompt, "return_logprob": True, "return_prompt_token_ids": True}
    )
    meta = with_logprobs["meta_info"]
    assert meta["input_token_logprobs"] == []
    assert meta["output_token_logprobs_length"] == len(with_logprobs["output_ids"])
    assert with_logprobs["prompt_token_ids"] == prompt


@pytest.mark.parametrize(
    ("return_text", "texts"),
    [(False, "null"), (True, "decoded")],
    ids=["ids-only", "return_text_in_logprobs"],
)
async def test_logprob_entries_carry_token_text_when_asked(
    serve: Serve, tokenizer: Any, return_text: bool, texts: str
) -> None:
    client, _ = await serve()
    answer = await generate(
        client,
        {
            "input_ids": render(tokenizer, MESSAGES, add_generation_prompt=True),
            "return_logprob": True,
            "return_text_in_logprobs": return_text,
        },
    )
    entries = answer["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == answer["output_ids"]
    if texts == "null":
        assert all(e[2] is None for e in entries)
    else:
        # TokenizerManager.detokenize_logprob_tokens: each id decoded alone, specials kept.
        assert [e[2] for e in entries] == [tokenizer.decode([e[1]]) for e in entries]
        assert entries[-1][2] == "<|im_end|>"


@pytest.mark.parametrize(
    ("sampling", "budget", "finish"),
    [
        ({}, 128, "length"),
        ({"max_new_tokens": None}, 200, "stop"),
        ({"max_new_tokens": 7}, 7, "length"),
    ],
    ids=["omitted-is-128", "null-is-no-limit", "explicit"],
)
async def test_max_new_tokens_default_and_null(
    serve: Serve, sampling: dict[str, Any], budget: int, finish: str
) -> None:
    client, _ = await serve(completion_tokens=200)
    answer = await generate(client, {"input_ids": [5, 6, 7], "sampling_params": sampling})
    assert len(answer["output_ids"]) == budget
    assert answer["meta_info"]["finish_reason"]["type"] == finish
    if finish == "length":
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": budget}


async def test_max_new_tokens_over_the_context_is_refused(serve: Serve) -> None:
    client, _ = await serve(context_length=64)
    too_many = await client.post(
        "/generate", json={"input_ids": list(range(60)), "sampling_params": {"max_new_tokens": 10}}
    )
    assert native_error(too_many).startswith(
        "Requested token count exceeds the model's maximum context length of 64 tokens."
    )
    # Omitted (128) is not checked up front: the scheduler clamps it to the context.
    clamped = await generate(client, {"input_ids": list(range(60))})
    assert len(clamped["output_ids"]) <= 4


@pytest.mark.parametrize(
    ("skip", "no_trim", "ends_with_stop"),
    [(None, None, False), (False, None, False), (True, True, False), (False, True, True)],
    ids=["defaults", "keep-specials", "no-trim-skipped", "no-trim-kept"],
)
async def test_text_trims_the_matched_stop_token(
    serve: Serve,
    tokenizer: Any,
    skip: bool | None,
    no_trim: bool | None,
    ends_with_stop: bool,
) -> None:
    client, _ = await serve()
    prompt = render(tokenizer, MESSAGES, add_generation_prompt=True)
    answer = await generate(
        client,
        {
            "input_ids": prompt,
            "sampling_params": {"skip_special_tokens": skip, "no_stop_trim": no_trim},
        },
    )
    ids = answer["output_ids"]
    # output_ids keep the stop token; the text loses it unless no_stop_trim.
    assert ids[-1] == tokenizer.eos_token_id
    decoded_ids = ids if no_trim else ids[:-1]
    assert answer["text"] == tokenizer.decode(decoded_ids, skip_special_tokens=skip is not False)
    assert answer["text"].endswith("<|im_end|>") is ends_with_stop


async def test_special_tokens_are_skipped_unless_asked(serve: Serve, tokenizer: Any) -> None:
    # Qwen3 reasoning then a tool call: <think>/<tool_call> are plain added tokens,
    # so they stay either way; the text differs where special tokens are sampled.
    client, _ = await serve(chat_template=QWEN3, reasoning=True)
    prompt = render(
        tokenizer, MESSAGES, tools=TOOLS, chat_template=QWEN3, add_generation_prompt=True
    )
    body = {"input_ids": prompt, "sampling_params": {"no_stop_trim": True}}
    skipped = await generate(client, body)
    kept = await generate(
        client, {**body, "sampling_params": {"no_stop_trim": True, "skip_special_tokens": False}}
    )
    assert skipped["output_ids"] == kept["output_ids"]
    assert kept["text"] == skipped["text"] + "<|im_end|>"
    assert "<tool_call>" in skipped["text"] and "<think>" in skipped["text"]


GATE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("unknown-sampling-key", {"sampling_params": {"foo": 1}}, UNKNOWN_FOO),
    (
        "float-max-new-tokens",
        {"sampling_params": {"max_new_tokens": 1.5}},
        "invalid type: floating point `1.5`, expected i64",
    ),
    (
        "string-bool",
        {"sampling_params": {"skip_special_tokens": "yes"}},
        'invalid type: string "yes", expected a boolean',
    ),
    (
        "stop-not-a-string",
        {"sampling_params": {"stop": 3}},
        "invalid type: integer `3`, expected a value or an array of values for StringOrList",
    ),
    (
        "stop-list-item",
        {"sampling_params": {"stop": ["a", 3]}},
        "invalid type: integer `3`, expected a string",
    ),
    (
        "logit-bias-value",
        {"sampling_params": {"logit_bias": {"5": "x"}}},
        'invalid type: string "x", expected f64',
    ),
    (
        "watermark-unknown-key",
        {"sampling_params": {"watermark": {"nope": 1}}},
        "unknown field `nope`, expected one of `enabled`, `key`, `context_window`",
    ),
    (
        "lax-bool-top-level",
        {"return_text_in_logprobs": "true"},
        'invalid type: string "true", expected a boolean',
    ),
    ("float-priority", {"priority": 7.0}, "invalid type: floating point `7.0`, expected i64"),
    (
        "rid-not-a-string",
        {"rid": 5},
        "invalid type: integer `5`, expected a value or an array of values for StringOrList",
    ),
]


@pytest.mark.parametrize(
    ("fields", "message"), [c[1:] for c in GATE_CASES], ids=[c[0] for c in GATE_CASES]
)
async def test_contract_gate_refuses_with_serde_text(
    serve: Serve, fields: dict[str, Any], message: str
) -> None:
    client, emulator = await serve()
    response = await client.post("/generate", json={"input_ids": [1, 2, 3], **fields})
    assert gate_error(response) == message
    assert emulator.requests[-1].route == "generate"


async def test_null_is_accepted_for_every_sampling_key(serve: Serve) -> None:
    client, _ = await serve(completion_tokens=3)
    nulls = {key: None for key in SAMPLING_FIELDS}
    answer = await generate(
        client, {"input_ids": [1, 2, 3], "sampling_params": nulls, "not_a_field": {"x": 1}}
    )
    assert len(answer["output_ids"]) == 3  # max_new_tokens null: no limit


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0."),
        (
            {"sampling_params": {"temperature": -1.0}},
            "temperature must be a non-negative finite number, got -1.0.",
        ),
        ({"sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1, got 0."),
        (
            {"sampling_params": {"stop": [str(i) for i in range(33)]}},
            "at most 32 stop strings are allowed, got 33",
        ),
        (
            {"sampling_params": {"regex": "a+", "json_schema": "{}"}},
            "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
        ),
        (
            {"sampling_params": {"logit_bias": {"999999999": 1.0}}},
            "logit_bias must has keys in [0, 129277], got 999999999.",
        ),
        (
            {"sampling_params": {"json_schema": "{not json"}},
            "Failed to compile json grammar: Expecting property name enclosed in double "
            "quotes: line 1 column 2 (char 1)",
        ),
        (
            {"return_logprob": True, "logprob_start_len": 9},
            "req.logprob_start_len=9 is higher than the number of input tokens "
            "len(req.origin_input_ids)=3. Please use a smaller logprob_start_len.",
        ),
    ],
    ids=[
        "top-p", "temperature", "top-k", "33-stops", "two-grammars", "logit-bias-key",
        "json-schema-not-json", "logprob-start-past-prompt",
    ],
)  # fmt: skip
async def test_sampling_params_are_verified_like_sglang(
    serve: Serve, fields: dict[str, Any], message: str
) -> None:
    client, _ = await serve()
    response = await client.post("/generate", json={"input_ids": [1, 2, 3], **fields})
    assert native_error(response) == message


@pytest.mark.parametrize(
    "fields",
    [
        {"routed_experts_start_len": None},
        {"require_reasoning": None},
        {"sampling_params": "fast"},
        {"priority": "high"},
    ],
    ids=["start-len-null", "require-reasoning-null", "sampling-params-string", "priority-word"],
)
async def test_fastapi_validation_comes_first(serve: Serve, fields: dict[str, Any]) -> None:
    client, _ = await serve()
    response = await client.post("/generate", json={"input_ids": [1, 2, 3], **fields})
    assert response.status_code == 400
    assert set(response.json()) == FLAT_ERROR_KEYS
    assert response.json()["type"] == "Bad Request"


@pytest.mark.parametrize(
    "fields",
    [
        {"text": "hello"},
        {"image_data": "http://x/y.png"},
        {"rid": ["a", "b"]},
        {"return_logprob": True, "top_logprobs_num": 2},
        {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1},
        {"return_logprob": True, "logprob_start_len": -2},
        {"sampling_params": {"n": 2}},
        {"sampling_params": {"max_new_tokens": 0}, "session_params": {"id": "s"}},
        {"sampling_params": {"max_new_tokens": 0}, "return_routed_experts": True},
    ],
    ids=[
        "text", "image", "batch-rid", "top-logprobs", "top-prompt-logprobs",
        "logprob-start-below-minus-one", "n-2", "prefill-only-session",
        "prefill-only-routed-experts",
    ],
)  # fmt: skip
async def test_what_the_emulator_cannot_answer_is_refused(
    serve: Serve, fields: dict[str, Any]
) -> None:
    client, _ = await serve()
    response = await client.post("/generate", json={"input_ids": [1, 2, 3], **fields})
    assert native_error(response)


@pytest.fixture(scope="module")
def sglang_api_types() -> types.ModuleType:
    return or_skip(load_api_types)


_VALUES: list[Any] = [
    None, True, 0, -3, 1.5, 2.0, "x", [], [1], [1.5], ["a"], [None], [[1]], [["a"]], {},
    {"a": 1}, {"enabled": True}, {"foo": 1}, [{}], [{"foo": 1}],
]  # fmt: skip
_UNPORTED = {"image_data", "video_data", "audio_data", "kv_hints", "images_config"}


def test_the_gate_is_sglangs_own(sglang_api_types: types.ModuleType) -> None:
    """`contract_error` gives the generated decoder's text for every field and
    value shape (the media, kv_hints and images_config decoders are not ported)."""

    def theirs(body: dict[str, Any]) -> str | None:
        try:
            sglang_api_types.GenerateRequest.from_json_value(body)
        except sglang_api_types.JsonContractError as exc:
            return str(exc)
        return None

    request_fields = sglang_api_types.GenerateRequest.__struct_fields__
    bodies: list[dict[str, Any]] = [
        {key: value} for key in request_fields if key not in _UNPORTED for value in _VALUES
    ]
    bodies += [
        {"sampling_params": shape(key, value)}
        for key in (*SAMPLING_FIELDS, "foo")
        for value in _VALUES
        for shape in (lambda k, v: {k: v}, lambda k, v: [{k: v}])
    ]
    assert [contract_error(b) for b in bodies] == [theirs(b) for b in bodies]
    assert theirs({"sampling_params": {"foo": 1}}) == UNKNOWN_FOO


@pytest.mark.parametrize(
    ("schema", "called"),
    [
        (json_schema(TOOLS, "required"), ["read_file"]),
        (json_schema(TOOLS, {"function": {"name": "list_dir"}}), ["list_dir"]),
        ('{"type": "object"}', ["read_file"]),  # a response format: no call forced
    ],
    ids=["required", "named", "other-schema"],
)
async def test_json_schema_tool_constraint(
    serve: Serve, tokenizer: Any, schema: str, called: list[str]
) -> None:
    client, _ = await serve()
    prompt = render(tokenizer, MESSAGES, tools=TOOLS, add_generation_prompt=True)
    answer = await generate(
        client,
        {"input_ids": prompt, "sampling_params": {"json_schema": schema, "max_new_tokens": None}},
    )
    text = tokenizer.decode(answer["output_ids"][:-1])
    names = [
        json.loads(block.split("</tool_call>")[0])["name"]
        for block in text.split("<tool_call>")[1:]
    ]
    assert names == called
    # After a tool result the model answers in text unless a call is forced.
    after = render(tokenizer, AFTER_TOOL, tools=TOOLS, add_generation_prompt=True)
    follow = await generate(
        client, {"input_ids": after, "sampling_params": {"json_schema": schema}}
    )
    forced = schema != '{"type": "object"}'
    assert ("<tool_call>" in follow["text"]) is forced


async def test_a_named_tool_the_prompt_does_not_offer_is_refused(
    serve: Serve, tokenizer: Any
) -> None:
    client, _ = await serve()
    nope = {"type": "function", "function": {"name": "nope", "parameters": {"type": "object"}}}
    prompt = render(tokenizer, MESSAGES, tools=TOOLS, add_generation_prompt=True)
    response = await client.post(
        "/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"json_schema": json_schema([nope], {"function": {"name": "nope"}})},
        },
    )
    assert "nope" in native_error(response)


async def test_routed_experts_on_generate_are_the_chat_blob(serve: Serve) -> None:
    client, _ = await serve(routed_experts_layers=3, routed_experts_top_k=2)
    prompt = list(range(500, 540))
    fields = {"return_routed_experts": True, "routed_experts_start_len": 10}
    by_chat = await chat(client, {"input_ids": prompt, "seed": 4, **fields})
    by_generate = await generate(
        client,
        {
            "input_ids": prompt,
            "sampling_params": {"sampling_seed": 4, "max_new_tokens": None},
            **fields,
        },
    )
    blob = by_generate["meta_info"]["routed_experts"]
    assert blob == by_chat["choices"][0]["meta_info"]["routed_experts"]
    forwarded = len(prompt) + len(by_generate["output_ids"]) - 1
    assert len(base64.b64decode(blob)) == (forwarded - 10) * 3 * 2 * 4
    past = await client.post(
        "/generate", json={"input_ids": prompt, **fields, "routed_experts_start_len": 10_000}
    )
    assert "routed_experts_start_len" in native_error(past)


# -- /parse_function_call and /separate_reasoning --------------------------


async def _parse_calls(
    client: httpx.AsyncClient, text: str, parser: str = "qwen25"
) -> dict[str, Any]:
    response = await client.post(
        "/parse_function_call", json={"text": text, "tools": TOOLS, "tool_call_parser": parser}
    )
    assert response.status_code == 200, response.text
    parsed: dict[str, Any] = response.json()
    return parsed


async def _separate(client: httpx.AsyncClient, text: str, **extra: Any) -> dict[str, Any]:
    response = await client.post(
        "/separate_reasoning", json={"text": text, "reasoning_parser": "qwen3", **extra}
    )
    assert response.status_code == 200, response.text
    parsed: dict[str, Any] = response.json()
    return parsed


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message's tool calls as /parse_function_call gives them."""
    offered: list[dict[str, Any]] = TOOLS
    names = [t["function"]["name"] for t in offered]
    return [
        {
            "tool_index": names.index(c["function"]["name"]),
            "name": c["function"]["name"],
            "parameters": c["function"]["arguments"],
        }
        for c in message.get("tool_calls") or []
    ]


@pytest.mark.parametrize("skip", [False, True], ids=["specials-kept", "specials-skipped"])
@pytest.mark.parametrize("messages", [MESSAGES, ASK_ALL], ids=["one-call", "parallel-calls"])
async def test_parse_function_call_round_trip(
    serve: Serve, tokenizer: Any, messages: list[Any], skip: bool
) -> None:
    client, emulator = await serve(**CHATML)
    prompt = render(tokenizer, messages, tools=TOOLS, add_generation_prompt=True)
    by_chat = await chat(client, {"messages": messages, "tools": TOOLS, "input_ids": prompt})
    answer = await generate(
        client,
        {
            "input_ids": prompt,
            "sampling_params": {"skip_special_tokens": skip, "max_new_tokens": None},
        },
    )
    parsed = await _parse_calls(client, answer["text"])
    message = by_chat["choices"][0]["message"]
    assert parsed == {"normal_text": message["content"], "calls": _calls(message)}
    assert len(parsed["calls"]) == (2 if messages is ASK_ALL else 1)
    # Kimi K2's detector numbers the calls instead.
    kimi = await _parse_calls(client, answer["text"], "kimi_k2")
    assert [c["tool_index"] for c in kimi["calls"]] == list(range(len(parsed["calls"])))
    # A call of a function the request does not list is dropped (parse_base_json).
    only_second = await client.post(
        "/parse_function_call",
        json={"text": answer["text"], "tools": TOOLS[1:], "tool_call_parser": "qwen25"},
    )
    assert [c["name"] for c in only_second.json()["calls"]] == (
        ["list_dir"] if messages is ASK_ALL else []
    )
    assert emulator.parse_calls == {"parse_function_call": 3}


async def test_reasoning_then_tools_round_trip_on_qwen3(serve: Serve, tokenizer: Any) -> None:
    """The chat route's order: reasoning split first, tool calls parsed from the rest."""
    client, _ = await serve(**THINKING)
    prompt = render(
        tokenizer, MESSAGES, tools=TOOLS, chat_template=QWEN3, add_generation_prompt=True
    )
    body = {"messages": MESSAGES, "tools": TOOLS, "input_ids": prompt, "seed": 3}
    message = (await chat(client, body))["choices"][0]["message"]
    answer = await generate(
        client,
        {"input_ids": prompt, "sampling_params": {"sampling_seed": 3, "max_new_tokens": None}},
    )
    split = await _separate(client, answer["text"])
    assert split["reasoning_text"] == message["reasoning_content"]
    assert split["text"].startswith("<tool_call>")
    assert await _parse_calls(client, split["text"]) == {
        "normal_text": "",
        "calls": _calls(message),
    }
    # The rest holds no reasoning.
    assert await _separate(client, split["text"]) == {"reasoning_text": "", "text": split["text"]}


async def test_separate_reasoning_round_trip(serve: Serve, tokenizer: Any) -> None:
    client, _ = await serve(**THINKING)
    prompt = render(tokenizer, MESSAGES, chat_template=QWEN3, add_generation_prompt=True)
    by_chat = await chat(client, {"messages": MESSAGES, "input_ids": prompt, "_template": QWEN3})
    message = by_chat["choices"][0]["message"]
    # The chat route's sample is remembered too: its text, as /generate would give it.
    text = tokenizer.decode(sampled(by_chat)[0][:-1], skip_special_tokens=True)
    split = await _separate(client, text)
    assert split == {"reasoning_text": message["reasoning_content"], "text": message["content"]}
    # A think-start prefix (how a client forces reasoning) parses the same.
    assert await _separate(client, "<think>" + text) == split
    blocks = await _separate(client, text, return_blocks=True)
    assert blocks["blocks"] == [
        {"type": "reasoning", "text": message["reasoning_content"]},
        {"type": "text", "text": message["content"]},
    ]
    # The text answer has no tool calls.
    assert await _parse_calls(client, message["content"]) == {
        "normal_text": message["content"],
        "calls": [],
    }


@pytest.mark.parametrize(
    ("path", "body", "status", "shape"),
    [
        ("/parse_function_call", {"tool_call_parser": "qwen25"}, 400, "refused"),
        ("/separate_reasoning", {"reasoning_parser": "qwen3"}, 400, "refused"),
        ("/parse_function_call", {}, 500, "internal"),
        ("/parse_function_call", {"tool_call_parser": "nope"}, 500, "internal"),
        ("/separate_reasoning", {"reasoning_parser": "nope"}, 500, "internal"),
        ("/separate_reasoning", {}, 400, "validation"),
        ("/parse_function_call", {"tool_call_parser": "deepseekv4"}, 400, "not-served"),
    ],
    ids=[
        "unknown-text-tools", "unknown-text-reasoning", "no-tool-parser", "unknown-tool-parser",
        "unknown-reasoning-parser", "no-reasoning-parser", "adapter-parser",
    ],
)  # fmt: skip
async def test_parse_routes_refuse_loudly(
    serve: Serve, path: str, body: dict[str, Any], status: int, shape: str
) -> None:
    client, emulator = await serve()
    response = await client.post(path, json={"text": "never sampled", **body})
    assert response.status_code == status, response.text
    if shape == "refused":
        assert response.json() == {"error": {"message": NOT_SAMPLED}}
    elif shape == "internal":
        # Starlette's plain 500; SGLang's ValueError is only in its log (here: a header).
        assert response.text == "Internal Server Error"
        assert response.headers["x-emulator-error"].startswith("Unsupported")
    else:
        assert set(response.json()) == FLAT_ERROR_KEYS
    assert emulator.parse_calls["refused"] == 1
    stats = (await client.get("/emulator/stats")).json()
    assert sum(stats["parse_calls"].values()) == 2


def test_the_memo_is_bounded(tokenizer: Any) -> None:
    def decode(ids: Any, skip: bool) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=skip))

    memo = ParseMemo(decode, entries=8)
    words = encode(tokenizer, "the model reads data")
    for i in range(20):
        memo.note([*words, *encode(tokenizer, f" {i}")], {"role": "assistant", "content": str(i)})
    assert len(memo) == 8
    assert memo.lookup("the model reads data 0") is None
    assert memo.lookup("the model reads data 19") is not None
