"""The emulator's vLLM ``POST /v1/chat/completions/derender`` handler
(`vllm.derender.derender_chat`), called directly: it parses a tokens-mode
generate answer as ``output_mode: "derender"`` would have (every parser
configuration), a completion stitched from an aborted answer and its
continuation as the uninterrupted one, and refuses in vLLM's order, shape
and words (docs/research/vllm-0.33-derender.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from rollout_session.emulator.config import EmulatorConfig
from rollout_session.emulator.faults import FAULT_HEADER, Reply
from rollout_session.emulator.model.generation import Sample, TextModel
from rollout_session.emulator.vllm.derender import Detokenizer, SampledAnswers, derender_chat
from rollout_session.emulator.vllm.worker import VllmWorker
from rollout_session.emulator.worker import Emulator
from tests.emulator.test_emulator import MESSAGES, TOOLS
from tests.emulator.test_emulator_vllm import (
    ASK_ALL,
    MESSAGE_KEYS,
    NAMED,
    QWEN3,
    contract_body,
    prompt_ids,
    tool_json_schema,
)

VLLM: dict[str, Any] = {"engine": "vllm", "enable_scale_out": True}
PARSERS = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}
RESPONSE_KEYS = [
    "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
    "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
    "ec_transfer_params", "metrics",
]  # fmt: skip
CHOICE_KEYS = [
    "index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
    "routed_experts", "weight_versions",
]  # fmt: skip


class Worker:
    """An emulated vLLM worker, its generate route called in-process, and the
    derender handler wired as the app will: its samples noted in a
    `SampledAnswers`, its tokenizer as a `Detokenizer`."""

    def __init__(self, emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
        self.emulator = emulator
        self.vllm = VllmWorker(emulator)
        self.answers = SampledAnswers(emulator.decode)
        tokenizer = emulator.model.tokenizer
        self.detok = Detokenizer(
            decode=emulator.decode,
            token_text=self.vllm.token_text,
            eos_token_id=tokenizer.eos_token_id,
            generation_eos_ids=self.vllm.extra_eos,
            vocab_size=emulator.model.vocab_size,
        )
        sample = emulator.sample

        def noting(*args: Any, **kwargs: Any) -> Sample:
            drawn = sample(*args, **kwargs)
            self.answers.note(drawn)
            return drawn

        monkeypatch.setattr(emulator, "sample", noting)

    async def generate(self, body: dict[str, Any], **headers: str) -> dict[str, Any]:
        reply = await self.vllm.generate(
            orjson.dumps(body), {"content-type": "application/json", **headers}
        )
        assert reply.status == 200, reply.body
        answer: dict[str, Any] = orjson.loads(reply.body)
        return answer

    def derender(self, body: Any, content_type: str = "application/json") -> Reply:
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        return derender_chat(raw, content_type, self.vllm.server, self.detok, self.answers)

    def derendered(self, body: Any) -> dict[str, Any]:
        reply = self.derender(body)
        assert reply.status == 200, reply.body
        answer: dict[str, Any] = orjson.loads(reply.body)
        return answer


@pytest.fixture
def worker(model: TextModel, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Worker]:
    def start(**overrides: Any) -> Worker:
        emulator = Emulator(EmulatorConfig(**VLLM, **overrides), model=model)
        return Worker(emulator, monkeypatch)

    return start


def chat_request(
    messages: list[dict[str, Any]], context: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """The ``ChatCompletionRequest`` whose parse context ``context`` is (the
    one ``/render`` would write for it)."""
    request: dict[str, Any] = {"messages": messages, "logprobs": True, "top_logprobs": 0}
    for key in ("tools", "tool_choice", "parallel_tool_calls", "include_reasoning"):
        if key in context:
            request[key] = context[key]
    if context.get("chat_template_kwargs"):
        request["chat_template_kwargs"] = context["chat_template_kwargs"]
    request.update(fields)
    return request


def derender_body(
    answer: dict[str, Any], prompt: list[int], chat: dict[str, Any] | None, **fields: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "generate_response": answer,
        "prompt_tokens": len(prompt),
        "prompt_token_ids": prompt,
        "chat_request": chat,
    }
    body.update(fields)
    return body


# -- the same parse as output_mode "derender" -----------------------------------------

# (config, messages, parse_context overrides, structured_outputs, history calls in messages)
CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any], Any, int]] = {
    "no-parser": ({"chat_template": QWEN3, "reasoning": True}, MESSAGES, {}, None, 0),
    "reasoning": (
        {"chat_template": QWEN3, "reasoning": True, "reasoning_parser": "qwen3"},
        MESSAGES, {}, None, 0,
    ),
    "reasoning-hidden": (
        {"chat_template": QWEN3, "reasoning": True, "reasoning_parser": "qwen3"},
        MESSAGES, {"include_reasoning": False}, None, 0,
    ),
    "tools-auto": ({"tool_call_parser": "hermes"}, MESSAGES, {"tools": TOOLS}, None, 0),
    "tools-parallel": ({"tool_call_parser": "hermes"}, ASK_ALL, {"tools": TOOLS}, None, 0),
    "tools-parallel-false": (
        {"tool_call_parser": "hermes"}, ASK_ALL,
        {"tools": TOOLS, "parallel_tool_calls": False}, None, 0,
    ),
    "tools-required": (
        {"tool_call_parser": "hermes"}, MESSAGES,
        {"tools": TOOLS, "tool_choice": "required"}, {"json": tool_json_schema("required")}, 0,
    ),
    "tools-named": (
        {"tool_call_parser": "hermes"}, MESSAGES,
        {"tools": TOOLS, "tool_choice": NAMED}, {"json": json.dumps(tool_json_schema(NAMED))}, 0,
    ),
    "tools-none": (
        {"tool_call_parser": "hermes"}, MESSAGES, {"tools": TOOLS, "tool_choice": "none"},
        None, 0,
    ),
    "reasoning-and-tools": (
        {"chat_template": QWEN3, "reasoning": True, **PARSERS}, MESSAGES, {"tools": TOOLS},
        None, 0,
    ),
    "kimi-history": ({"tool_call_parser": "kimi_k2"}, ASK_ALL, {"tools": TOOLS}, None, 2),
}  # fmt: skip


def history(calls: int) -> list[dict[str, Any]]:
    """Assistant turns holding `calls` tool calls (counted, never rendered)."""
    return [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": f"c{i}",
                    "type": "function",
                    "function": {"name": "list_dir", "arguments": "{}"},
                }
                for i in range(calls)
            ],
        }
    ]


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
async def test_derender_is_the_generate_routes_derender(
    worker: Callable[..., Worker],
    tokenizer: Any,
    case: tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any], Any, int],
) -> None:
    """The tokens-mode answer, derendered, is the derender-mode answer's
    message, finish reason and logprobs (the chat cut of ``top_logprobs`` 0)."""
    config, messages, context, structured, calls = case
    w = worker(**config)
    template = {"chat_template": QWEN3} if "chat_template" in config else {}
    tools = {"tools": TOOLS} if "tools" in context else {}
    prompt = prompt_ids(tokenizer, messages, **tools, **template)
    context = {"tool_choice": "auto", **context} if "tools" in context else context
    overrides = {
        "sampling": {"structured_outputs": structured, "skip_special_tokens": False},
        "parse_context": {**context, "history_tool_call_cnt": calls},
    }
    derendered = await w.generate(contract_body(prompt, **overrides))
    tokens = await w.generate(contract_body(prompt, output_mode="tokens", **overrides))
    [expected] = derendered["choices"]
    [sampled] = tokens["choices"]
    assert sampled["token_ids"] == (expected["token_ids"] or sampled["token_ids"])
    chat = chat_request(history(calls) + messages, context)
    answer = w.derendered(derender_body(tokens, prompt, chat))
    assert list(answer) == RESPONSE_KEYS
    [choice] = answer["choices"]
    assert list(choice) == CHOICE_KEYS
    assert choice["message"] == expected["message"]
    assert (choice["finish_reason"], choice["stop_reason"]) == (
        expected["finish_reason"],
        expected["stop_reason"],
    )
    assert choice["logprobs"] == expected["logprobs"]  # None when reasoning is hidden
    assert (choice["token_ids"], choice["routed_experts"], choice["weight_versions"]) == (
        None,
        None,
        None,
    )
    n = len(sampled["token_ids"])
    assert answer["usage"] == {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + n,
        "completion_tokens": n,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert (answer["id"], answer["object"], answer["model"]) == (
        tokens["request_id"],
        "chat.completion",
        "rollout-session/emulator",
    )


async def test_the_sampled_calls_and_reasoning_come_back(
    worker: Callable[..., Worker], tokenizer: Any
) -> None:
    """Not vacuous: the parsers' configuration yields reasoning and a call."""
    w = worker(chat_template=QWEN3, reasoning=True, **PARSERS)
    prompt = prompt_ids(tokenizer, tools=TOOLS, chat_template=QWEN3)
    tokens = await w.generate(contract_body(prompt, output_mode="tokens"))
    chat = chat_request(MESSAGES, {"tools": TOOLS})
    [choice] = w.derendered(derender_body(tokens, prompt, chat))["choices"]
    message = choice["message"]
    assert list(message) == [*MESSAGE_KEYS, "tool_calls", "reasoning"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["read_file"]
    assert message["reasoning"] and message["content"] is None
    assert choice["finish_reason"] == "tool_calls"
    # Kimi's ids count on from the chat request's history.
    kimi = worker(tool_call_parser="kimi_k2")
    prompt = prompt_ids(tokenizer, ASK_ALL, tools=TOOLS)
    tokens = await kimi.generate(contract_body(prompt, output_mode="tokens"))
    chat = chat_request(history(3) + ASK_ALL, {"tools": TOOLS})
    [choice] = kimi.derendered(derender_body(tokens, prompt, chat))["choices"]
    ids = [c["id"] for c in choice["message"]["tool_calls"]]
    assert ids == ["functions.read_file:3", "functions.list_dir:4"]


# -- a stitched completion ----------------------------------------------------------------

# Where the aborted first request stopped, as a function of the answer's text.
CUTS: dict[str, Callable[[list[int], Callable[[list[int]], str]], int]] = {
    "first-token": lambda ids, text: 1,
    "mid-reasoning": lambda ids, text: next(
        k for k in range(1, len(ids)) if "<think>" in text(ids[:k]) and len(text(ids[:k])) > 12
    ),
    "after-reasoning": lambda ids, text: next(
        k for k in range(1, len(ids)) if "</think>" in text(ids[:k])
    ),
    "mid-tool-call": lambda ids, text: next(
        k for k in range(1, len(ids)) if '"name"' in text(ids[:k])
    ),
    "before-end-token": lambda ids, text: len(ids) - 1,
}


@pytest.mark.parametrize("cut", list(CUTS.values()), ids=list(CUTS))
async def test_a_stitched_completion_derenders_as_the_uninterrupted_one(
    worker: Callable[..., Worker],
    tokenizer: Any,
    cut: Callable[[list[int], Callable[[list[int]], str]], int],
) -> None:
    """A: aborted after k tokens (finish_reason "abort"); B: its continuation
    (prompt + A's ids) to the end. The body carries A's ids then B's, B's
    finish and stop reasons, the original prompt, and the chat request: its
    derender is the uninterrupted answer's, which A's alone is not."""
    w = worker(chat_template=QWEN3, reasoning=True, **PARSERS)
    prompt = prompt_ids(tokenizer, tools=TOOLS, chat_template=QWEN3)
    context = {"tools": TOOLS, "tool_choice": "auto"}
    overrides = {"sampling": {"skip_special_tokens": False}, "parse_context": context}
    whole = await w.generate(contract_body(prompt, **overrides))
    tokens = await w.generate(contract_body(prompt, output_mode="tokens", **overrides))
    [expected] = whole["choices"]
    [full] = tokens["choices"]
    ids: list[int] = full["token_ids"]
    k = cut(ids, lambda part: tokenizer.decode(part))
    entries = full["logprobs"]["content"]
    a = {**full, "token_ids": ids[:k], "finish_reason": "abort", "stop_reason": None}
    a["logprobs"] = {"content": entries[:k]}
    b = {**full, "token_ids": ids[k:], "logprobs": {"content": entries[k:]}}
    # The stitched answer: A's then B's ids and logprobs, B's ending, the
    # versions of both (derender ignores them), the first prompt.
    stitched = {
        **full,
        "token_ids": a["token_ids"] + b["token_ids"],
        "logprobs": {"content": a["logprobs"]["content"] + b["logprobs"]["content"]},
        "weight_versions": [
            {"version": "v1", "start": 0, "end": k},
            {"version": "v2", "start": k, "end": len(ids)},
        ],
    }
    response = {**tokens, "prompt_token_ids": prompt, "choices": [stitched]}
    chat = chat_request(MESSAGES, context)
    [choice] = w.derendered(derender_body(response, prompt, chat))["choices"]
    assert choice["message"] == expected["message"]
    assert choice["finish_reason"] == expected["finish_reason"] == "tool_calls"
    assert choice["logprobs"] == expected["logprobs"]
    assert choice["weight_versions"] is None
    # A alone: a partial answer, finish reason "abort": no call until its
    # text holds the whole answer (all but the end token).
    partial = {**tokens, "choices": [a]}
    [alone] = w.derendered(derender_body(partial, prompt, chat))["choices"]
    assert alone["finish_reason"] == "abort"
    if k < len(ids) - 1:
        assert "tool_calls" not in alone["message"]
    else:
        assert alone["message"] == expected["message"]


def tokens_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A derender-mode choice as the tokens-mode one derender accepts: its
    message dropped, its finish reason as the engine gave it (derender mode
    rewrote "stop" to "tool_calls"), each logprob entry keyed by its sampled
    id (logprobs 0: no candidates, so nothing is lost)."""
    entries = choice["logprobs"]["content"]
    reason = "stop" if choice["finish_reason"] == "tool_calls" else choice["finish_reason"]
    return {
        **{k: v for k, v in choice.items() if k != "message"},
        "finish_reason": reason,
        "logprobs": {
            "content": [
                {"token_id": t, "logprob": e["logprob"], "top_logprobs": []}
                for t, e in zip(choice["token_ids"], entries, strict=True)
            ]
        },
    }


async def test_the_session_servers_recipe_from_derender_mode_answers(
    worker: Callable[..., Worker], tokenizer: Any
) -> None:
    """What the session server holds are derender-mode answers: A, aborted
    inside the reasoning, and B, its continuation. Rebuilt as a tokens-mode
    answer (ids A+B, B's ending, the first prompt), it derenders as the
    uninterrupted answer; sent as they are, derender refuses them."""
    w = worker(chat_template=QWEN3, reasoning=True, **PARSERS)
    prompt = prompt_ids(tokenizer, tools=TOOLS, chat_template=QWEN3)
    context = {"tools": TOOLS, "tool_choice": "auto"}
    overrides = {"sampling": {"skip_special_tokens": False}, "parse_context": context}
    whole = await w.generate(contract_body(prompt, **overrides))
    [expected] = whole["choices"]
    ids, entries, k = expected["token_ids"], expected["logprobs"]["content"], 5
    a = {**expected, "token_ids": ids[:k], "finish_reason": "abort", "stop_reason": None}
    b = {**expected, "token_ids": ids[k:]}
    a["logprobs"], b["logprobs"] = {"content": entries[:k]}, {"content": entries[k:]}
    chat = chat_request(MESSAGES, context)
    refused = w.derender(derender_body({**whole, "choices": [a]}, prompt, chat))
    assert refused.status == 400 and b"Input should be 'tokens'" in refused.body
    first, rest = tokens_choice(a), tokens_choice(b)
    stitched = {
        **rest,
        "token_ids": first["token_ids"] + rest["token_ids"],
        "logprobs": {"content": first["logprobs"]["content"] + rest["logprobs"]["content"]},
    }
    response = {
        "request_id": whole["request_id"],
        "output_mode": "tokens",
        "prompt_token_ids": prompt,
        "choices": [stitched],
    }
    [choice] = w.derendered(derender_body(response, prompt, chat))["choices"]
    assert choice["message"] == expected["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["logprobs"] == expected["logprobs"]


async def test_an_abort_one_token_short_is_the_whole_answer(
    worker: Callable[..., Worker], tokenizer: Any
) -> None:
    """The emulator's "abort" fault stops before the end token: its text is
    the whole answer's, on both routes (finish reason "abort", kept)."""
    w = worker(tool_call_parser="hermes")
    prompt = prompt_ids(tokenizer, tools=TOOLS)
    context = {"tools": TOOLS, "tool_choice": "auto"}
    overrides = {"sampling": {"skip_special_tokens": False}, "parse_context": context}
    fault = {FAULT_HEADER.lower(): "abort"}
    whole = await w.generate(contract_body(prompt, **overrides), **fault)
    tokens = await w.generate(contract_body(prompt, output_mode="tokens", **overrides), **fault)
    [expected] = whole["choices"]
    assert expected["finish_reason"] == "abort" and expected["message"]["tool_calls"]
    [choice] = w.derendered(derender_body(tokens, prompt, chat_request(MESSAGES, context)))[
        "choices"
    ]
    assert choice["message"] == expected["message"]
    assert choice["finish_reason"] == "abort"


# -- decoding: stop tokens, stop strings, special tokens ----------------------------------


async def test_stop_strings_and_stop_tokens_cut_as_the_engine_did(
    worker: Callable[..., Worker], tokenizer: Any
) -> None:
    w = worker(completion_tokens=40)
    prompt = prompt_ids(tokenizer)
    [full] = (await w.generate(contract_body(prompt, output_mode="text")))["choices"]
    stop = f" {full['text'].split(' ')[3]}"
    for include in (False, True):
        sampling = {"stop": [stop], "include_stop_str_in_output": include}
        text = await w.generate(contract_body(prompt, output_mode="text", sampling=sampling))
        tokens = await w.generate(contract_body(prompt, output_mode="tokens", sampling=sampling))
        [cut] = text["choices"]
        chat = chat_request(MESSAGES, {}, stop=[stop], include_stop_str_in_output=include)
        # Reported stop string, or (an older host) none: the request's list.
        for reported in (stop, None):
            tokens["choices"][0]["stop_reason"] = reported
            [choice] = w.derendered(derender_body(tokens, prompt, chat))["choices"]
            assert choice["message"]["content"] == cut["text"]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    # A stop token id: reported, or found in the request's stop_token_ids.
    token = full["token_ids"][5]
    sampling = {"stop_token_ids": [token]}
    tokens = await w.generate(contract_body(prompt, output_mode="tokens", sampling=sampling))
    chat = chat_request(MESSAGES, {}, stop_token_ids=[token])
    for reported in (token, None):
        tokens["choices"][0]["stop_reason"] = reported
        [choice] = w.derendered(derender_body(tokens, prompt, chat))["choices"]
        assert choice["message"]["content"] == tokenizer.decode(full["token_ids"][:5])
        assert choice["stop_reason"] == token
    # The end token is left out only for finish_reason "stop" (null reads
    # "stop" but keeps it), and not under ignore_eos.
    tokens = await w.generate(contract_body(prompt, output_mode="tokens"))
    ids = tokens["choices"][0]["token_ids"]
    special = chat_request(MESSAGES, {}, skip_special_tokens=False)
    ignore = chat_request(MESSAGES, {}, skip_special_tokens=False, ignore_eos=True)
    for chat, reason, shown in (
        (special, "stop", ids[:-1]),
        (special, "length", ids),
        (special, None, ids),
        (ignore, "stop", ids),
    ):
        tokens["choices"][0]["finish_reason"] = reason
        [choice] = w.derendered(derender_body(tokens, prompt, chat))["choices"]
        assert choice["message"]["content"] == tokenizer.decode(shown)
        assert choice["finish_reason"] == (reason or "stop")
    assert tokenizer.decode(ids) != tokenizer.decode(ids[:-1])


async def test_without_a_parser_the_request_chooses_special_tokens(
    worker: Callable[..., Worker], tokenizer: Any
) -> None:
    """No parser: the text is the content, decoded with the chat request's
    ``skip_special_tokens`` (true without a chat request)."""
    w = worker(chat_template=QWEN3, reasoning=True)
    prompt = prompt_ids(tokenizer, tools=TOOLS, chat_template=QWEN3)
    tokens = await w.generate(contract_body(prompt, output_mode="tokens"))
    ids = tokens["choices"][0]["token_ids"]
    for chat, skip in (
        (None, True),
        (chat_request(MESSAGES, {}, skip_special_tokens=False), False),
    ):
        [choice] = w.derendered(derender_body(tokens, prompt, chat))["choices"]
        assert choice["message"]["content"] == tokenizer.decode(ids[:-1], skip_special_tokens=skip)
        assert choice["message"]["reasoning"] is None and "tool_calls" not in choice["message"]


async def test_token_ids_logprobs_and_passthrough_fields(
    worker: Callable[..., Worker], tokenizer: Any
) -> None:
    w = worker()
    prompt = prompt_ids(tokenizer)
    tokens = await w.generate(contract_body(prompt, output_mode="tokens", return_token_ids=True))
    tokens["kv_transfer_params"] = {"k": 1}
    tokens["ec_transfer_params"] = {"e": 2}
    ids = tokens["choices"][0]["token_ids"]
    chat = chat_request(MESSAGES, {}, return_token_ids=True, logprobs=False, model="alias")
    answer = w.derendered(
        derender_body(tokens, prompt, chat, model="rollout-session/emulator", prompt_tokens=None)
    )
    [choice] = answer["choices"]
    assert choice["token_ids"] == ids and answer["prompt_token_ids"] == prompt
    # logprobs false says nothing of the cut: every candidate generate sent.
    entries = choice["logprobs"]["content"]
    assert [len(e["top_logprobs"]) for e in entries] == [1] * len(ids)
    assert entries[0]["token"] == tokenizer.decode([ids[0]])
    assert entries[0]["top_logprobs"][0]["logprob"] == entries[0]["logprob"]
    assert answer["kv_transfer_params"] == {"k": 1} and answer["ec_transfer_params"] is None
    assert answer["usage"]["prompt_tokens"] == 0  # prompt_tokens omitted: 0
    # top_logprobs -1: all of them; logprobs null: none.
    chat = chat_request(MESSAGES, {}, top_logprobs=-1)
    [choice] = w.derendered(derender_body(tokens, prompt, chat))["choices"]
    assert choice["logprobs"]["content"][0]["top_logprobs"] != []
    tokens["choices"][0]["logprobs"] = None
    [choice] = w.derendered(derender_body(tokens, prompt, chat))["choices"]
    assert choice["logprobs"] is None
    tokens["choices"][0]["logprobs"] = {"content": None}
    [choice] = w.derendered(derender_body(tokens, prompt, chat))["choices"]
    assert choice["logprobs"] == {"content": None}
    # An empty choices list derenders to none; no output_mode means tokens.
    del tokens["output_mode"]
    tokens["choices"] = []
    answer = w.derendered(derender_body(tokens, prompt, None))
    assert answer["choices"] == [] and answer["usage"]["completion_tokens"] == 0


# -- refusals -------------------------------------------------------------------------------

ANSWER: dict[str, Any] = {"choices": [{"index": 0, "token_ids": [1000, 1001]}]}


def both_missing(n: int) -> str:
    """The streaming member's errors for a body of `n` keys without its fields."""
    return "\n  ".join(
        "{'type': 'missing', 'loc': 'body.DerenderChatStreamRequest." + field + "', 'msg': "
        "'Field required', 'input': '<dict of " + str(n) + " items>'}"
        for field in ("stream", "generate_chunk")
    )


def _errors(first: str, n: int = 1, count: int = 3) -> str:
    return f"{count} validation errors:\n  {first}\n  " + both_missing(n)


# name -> (server config, body or raw bytes, content type, status, type, param, message)
REFUSALS: dict[str, tuple[dict[str, Any], Any, str, int, str, str | None, str]] = {
    "content-type": (
        {}, {"generate_response": ANSWER}, "text/plain", 400, "Bad Request", None,
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
    ),
    "content-type-spaced": (
        {}, {"generate_response": ANSWER}, "application/json ; charset=utf-8", 400,
        "Bad Request", None,
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
    ),
    "json": (
        {}, b"{", "application/json", 400, "Bad Request", "body.1",
        "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON "
        "decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property "
        "name enclosed in double quotes'}}",
    ),
    "not-an-object": (
        {}, [1], "application/json", 400, "Bad Request", "body.DerenderChatRequest",
        "2 validation errors:\n  {'type': 'model_type', 'loc': 'body.DerenderChatRequest', "
        "'msg': 'Input should be a valid dictionary or instance of DerenderChatRequest', "
        "'input': '<list of 1 items>', 'ctx': {'class_name': 'DerenderChatRequest'}}\n  "
        "{'type': 'model_type', 'loc': 'body.DerenderChatStreamRequest', 'msg': 'Input should "
        "be a valid dictionary or instance of DerenderChatStreamRequest', 'input': '<list of "
        "1 items>', 'ctx': {'class_name': 'DerenderChatStreamRequest'}}",
    ),
    "missing-generate-response": (
        {}, {}, "application/json", 400, "Bad Request",
        "body.DerenderChatRequest.generate_response",
        _errors(
            "{'type': 'missing', 'loc': 'body.DerenderChatRequest.generate_response', 'msg': "
            "'Field required', 'input': '<dict of 0 items>'}", n=0,
        ),
    ),
    "derender-mode-answer": (
        {}, {"generate_response": {**ANSWER, "output_mode": "derender"}}, "application/json",
        400, "Bad Request", "body.DerenderChatRequest.generate_response.output_mode",
        _errors(
            "{'type': 'literal_error', 'loc': "
            "'body.DerenderChatRequest.generate_response.output_mode', 'msg': \"Input should "
            "be 'tokens'\", 'input': 'derender', 'ctx': {'expected': \"'tokens'\"}}"
        ),
    ),
    "negative-id": (
        {}, {"generate_response": {"choices": [{"index": 0, "token_ids": [1, -2]}]}},
        "application/json", 400, "Bad Request",
        "body.DerenderChatRequest.generate_response.choices.0.token_ids",
        _errors(
            "{'type': 'value_error', 'loc': "
            "'body.DerenderChatRequest.generate_response.choices.0.token_ids', 'msg': 'Value "
            "error, token_ids must not contain negative values', 'input': '<list of 2 items>', "
            "'ctx': {'error': ValueError('token_ids must not contain negative values')}}"
        ),
    ),
    "chat-shaped-logprobs": (
        {}, {"generate_response": {"choices": [{"index": 0, "token_ids": [1], "logprobs": {
            "content": [{"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}]
        }}]}}, "application/json", 400, "Bad Request",
        "body.DerenderChatRequest.generate_response.choices.0.logprobs.content.0.token_id",
        _errors(
            "{'type': 'missing', 'loc': "
            "'body.DerenderChatRequest.generate_response.choices.0.logprobs.content.0."
            "token_id', 'msg': 'Field required', 'input': '<dict of 4 items>'}"
        ),
    ),
    "stop-reason-type": (
        {},
        {"generate_response": {"choices": [{"index": 0, "token_ids": [1], "stop_reason": 1.5}]}},
        "application/json", 400, "Bad Request",
        "body.DerenderChatRequest.generate_response.choices.0.stop_reason",
        "4 validation errors:\n  {'type': 'int_from_float', 'loc': "
        "'body.DerenderChatRequest.generate_response.choices.0.stop_reason', 'msg': 'Input "
        "should be a valid integer, got a number with a fractional part', 'input': '1.5'}\n  "
        "{'type': 'string_type', 'loc': "
        "'body.DerenderChatRequest.generate_response.choices.0.stop_reason', 'msg': 'Input "
        "should be a valid string', 'input': '1.5'}\n  " + both_missing(1),
    ),
    "weight-versions": (
        {}, {"generate_response": {"choices": [{"index": 0, "token_ids": [1],
            "weight_versions": [{"version": "v", "start": 0}]}]}},
        "application/json", 400, "Bad Request",
        "body.DerenderChatRequest.generate_response.choices.0.weight_versions.0.end",
        _errors(
            "{'type': 'missing', 'loc': "
            "'body.DerenderChatRequest.generate_response.choices.0.weight_versions.0.end', "
            "'msg': 'Field required', 'input': '<dict of 2 items>'}"
        ),
    ),
    "stream-false-string": (
        {}, {"stream": "false", "generate_response": ANSWER}, "application/json", 400,
        "Bad Request", "body.DerenderChatRequest.stream",
        "3 validation errors:\n  {'type': 'literal_error', 'loc': "
        "'body.DerenderChatRequest.stream', 'msg': 'Input should be False', 'input': 'false', "
        "'ctx': {'expected': 'False'}}\n  {'type': 'literal_error', 'loc': "
        "'body.DerenderChatStreamRequest.stream', 'msg': 'Input should be True', 'input': "
        "'false', 'ctx': {'expected': 'True'}}\n  {'type': 'missing', 'loc': "
        "'body.DerenderChatStreamRequest.generate_chunk', 'msg': 'Field required', 'input': "
        "'<dict of 2 items>'}",
    ),
    "negative-prompt-id": (
        {}, {"generate_response": ANSWER, "prompt_token_ids": [-1]}, "application/json", 400,
        "Bad Request", "body.DerenderChatRequest.prompt_token_ids.0",
        "4 validation errors:\n  {'type': 'greater_than_equal', 'loc': "
        "'body.DerenderChatRequest.prompt_token_ids.0', 'msg': 'Input should be greater than "
        "or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}\n  " + both_missing(2)
        + "\n  {'type': 'greater_than_equal', 'loc': "
        "'body.DerenderChatStreamRequest.prompt_token_ids.0', 'msg': 'Input should be "
        "greater than or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}",
    ),
    "chat-request-without-messages": (
        {}, {"generate_response": ANSWER, "chat_request": {}}, "application/json", 400,
        "Bad Request", "body.DerenderChatRequest.chat_request.messages",
        "4 validation errors:\n  {'type': 'missing', 'loc': "
        "'body.DerenderChatRequest.chat_request.messages', 'msg': 'Field required', 'input': "
        "'<dict of 0 items>'}\n  " + both_missing(2)
        + "\n  {'type': 'missing', 'loc': 'body.DerenderChatStreamRequest.chat_request."
        "messages', 'msg': 'Field required', 'input': '<dict of 0 items>'}",
    ),
    # The chat request's "before" validators escape the union at once.
    "chat-request-empty-tools": (
        {}, {"generate_response": {"choices": 1}, "chat_request": {"messages": [], "tools": []}},
        "application/json", 400, "BadRequestError", "tools",
        "`tools` must not be an empty array. Either provide at least one tool or omit the "
        "field entirely. (parameter=tools)",
    ),
    "chat-request-tool-choice-without-tools": (
        {}, {"generate_response": ANSWER, "chat_request": {"messages": [], "tool_choice": "auto"}},
        "application/json", 400, "BadRequestError", "tool_choice",
        "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
    ),
    "unknown-model": (
        {}, {"model": "other", "generate_response": ANSWER}, "application/json", 404,
        "NotFoundError", "model",
        "The model `other` does not exist. Valid aliases: rollout-session/emulator.",
    ),
    "too-many-choices": (
        {}, {"generate_response": {"request_id": "r1", "choices": [{"index": 0}] * 16385}},
        "application/json", 400, "BadRequestError", None,
        "choices count (16385) in response 'r1' exceeds server maximum (16384).",
    ),
    "ids-over-the-context": (
        {"context_length": 64},
        {"generate_response": {"choices": [{"index": 3, "token_ids": [5] * 65}]}},
        "application/json", 400, "BadRequestError", None,
        "token_ids length (65) in choice 3 exceeds max_model_len (64).",
    ),
    "logprobs-over-the-context": (
        {"context_length": 64},
        {"generate_response": {"choices": [{"index": 0, "token_ids": [5], "logprobs": {
            "content": [{"token_id": 5, "logprob": -1.0}] * 65}}]}},
        "application/json", 400, "BadRequestError", None,
        "logprobs.content length (65) in choice 0 exceeds max_model_len (64).",
    ),
    "top-logprobs-over-max-logprobs": (
        {}, {"generate_response": {"choices": [{"index": 0, "token_ids": [5], "logprobs": {
            "content": [{"token_id": 5, "logprob": -1.0, "top_logprobs": [
                {"token_id": 5, "logprob": -1.0}] * 21}]}}]}},
        "application/json", 400, "BadRequestError", None,
        "top_logprobs count (21) in choice 0 exceeds max_logprobs (20).",
    ),
    "prompt-logprobs-over-the-context": (
        {"context_length": 64},
        {"generate_response": {**ANSWER, "request_id": "r2", "prompt_logprobs": [None] * 65}},
        "application/json", 400, "BadRequestError", None,
        "prompt_logprobs length (65) in response 'r2' exceeds max_model_len (64).",
    ),
    "prompt-ids-over-the-context": (
        {"context_length": 64},
        {"generate_response": ANSWER, "prompt_token_ids": [5] * 65}, "application/json", 400,
        "BadRequestError", None, "prompt_token_ids length (65) exceeds max_model_len (64).",
    ),
    "parser-without-chat-request": (
        {"reasoning_parser": "qwen3"}, {"generate_response": ANSWER}, "application/json", 400,
        "BadRequestError", None,
        "chat_request is required when a tool or reasoning parser is configured because "
        "plain detokenization would leak raw parser markup into content.",
    ),
    "empty-token-ids": (
        {},
        {"generate_response": {"choices": [*ANSWER["choices"], {"index": 1, "token_ids": []}]}},
        "application/json", 400, "BadRequestError", None,
        "choice 1 has empty or null token_ids",
    ),
    "null-token-ids": (
        {}, {"generate_response": {"choices": [{"index": 2}]}}, "application/json", 400,
        "BadRequestError", None, "choice 2 has empty or null token_ids",
    ),
    # The emulator's own: what vLLM serves and it does not model.
    "streaming": (
        {}, {"stream": True, "generate_chunk": {"choices": []}}, "application/json", 400,
        "BadRequestError", "stream",
        "the emulator does not model streaming derender (stream: true on "
        "/v1/chat/completions/derender): send stream: false",
    ),
    "prompt-logprobs": (
        {}, {"generate_response": {**ANSWER, "prompt_logprobs": [None]}}, "application/json",
        400, "BadRequestError", "prompt_logprobs",
        "the emulator does not model generate_response.prompt_logprobs on "
        "/v1/chat/completions/derender",
    ),
    "derender-finish-reason": (
        {}, {"generate_response": {"choices": [{**ANSWER["choices"][0],
            "finish_reason": "tool_calls"}]}}, "application/json", 400, "BadRequestError",
        "finish_reason",
        "the emulator does not model finish_reason 'tool_calls' in generate_response (the "
        "token route reports stop, length, abort or repetition; derender mode's tool_calls "
        "was stop)",
    ),
    "outside-the-vocabulary": (
        {}, {"generate_response": {"choices": [{"index": 0, "token_ids": [1, 10**7]}]}},
        "application/json", 400, "BadRequestError", "token_ids",
        "the emulator does not model token ids outside its vocabulary of 129278 (got "
        "[10000000])",
    ),
    "non-finite-logprob": (
        {}, b'{"generate_response": {"choices": [{"index": 0, "token_ids": [5], "logprobs": '
        b'{"content": [{"token_id": 5, "logprob": -Infinity}]}}]}}',
        "application/json", 400, "BadRequestError", "logprobs",
        "the emulator does not model non-finite logprobs in generate_response",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS.values()), ids=list(REFUSALS))
def test_refusals(
    worker: Callable[..., Worker],
    case: tuple[dict[str, Any], Any, str, int, str, str | None, str],
) -> None:
    config, body, content_type, status, type_, param, message = case
    reply = worker(**config).derender(body, content_type)
    assert reply.status == status, reply.body
    payload = orjson.loads(reply.body)
    assert list(payload) == ["error"]
    assert payload["error"] == {"message": message, "type": type_, "param": param, "code": status}


def test_sampled_answers_are_bounded_and_lazy(model: TextModel) -> None:
    decoded: list[list[int]] = []

    def decode(ids: Any, skip: bool) -> str:
        decoded.append(list(ids))
        return str(model.tokenizer.decode(ids, skip_special_tokens=skip))

    answers = SampledAnswers(decode, entries=2)
    words = [model.encode(f" {w}") for w in ("model", "data", "file")]
    for i, ids in enumerate(words):
        end = model.tokenizer.eos_token_id
        finish = {"type": "stop", "matched": end}
        answers.note(Sample([*ids, end], [-0.1] * (len(ids) + 1), finish, 0, {"content": str(i)}))
    assert decoded == []  # nothing decoded before a lookup
    assert answers.find(" file") == {"content": "2"}
    assert answers.find(" model") is None  # the oldest fell out
    assert len(answers) == 2 and len(decoded) == 2


def test_derender_is_pure(worker: Callable[..., Worker], tokenizer: Any) -> None:
    """No GPU time, nothing in flight or counted, no fault drawn: a sync call."""
    w = worker(fault="http_500")
    prompt = prompt_ids(tokenizer)
    reply = w.derender(derender_body(dict(ANSWER), prompt, None), "Application/JSON; charset=utf-8")
    assert reply.status == 200
    assert orjson.loads(reply.body)["choices"][0]["message"]["content"] == tokenizer.decode(
        ANSWER["choices"][0]["token_ids"]
    )
    assert (w.emulator.received, w.emulator.completed, dict(w.emulator.faults_injected)) == (
        0,
        0,
        {},
    )
