"""SGLang 0.5.23's ``POST /v1/chat/completions``, non-streaming, for the emulator.

Models ``srt/entrypoints/openai/serving_chat.py`` ``OpenAIServingChat``:
``_validate_request`` (the tools' schemas, ``tool_choice`` against
``tools``), then the prompt; the emulator's prompt is ``input_ids`` only
(it never renders ``messages``, which it only validates), and the tool
call ``tool_choice`` forces is the grammar ``get_json_schema_constraint``
(``srt/function_call/utils.py``) would build. The message is what the
worker's parsers make of the answer (`chat_message`: none by default, as
SGLang). Without a tokenizer (``--skip-tokenizer-init``) the tokenizer
manager refuses stop strings and ``min_tokens`` (``SamplingParams.normalize``),
and an answer the scheduler sends as ids has no ``text``, on which
``_build_chat_response`` fails (``ret_item["text"]``: a KeyError, which
``OpenAIServingBase.handle_request`` answers with a 500 after the request
ran); one aborted in the waiting queue has ``text`` ``""`` and is answered.
Injected faults (``faults``) pick the answer's fate; the answer is
`answer.chat_response`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson
import trio
from pydantic import TypeAdapter, ValidationError

from rollout_session.emulator.faults import (
    EARLY_FAULTS,
    BadRequest,
    Reply,
    context_length_message,
    early_fault_reply,
    error_body,
    fault_reply,
)
from rollout_session.emulator.model.forced_call import ToolConstraint
from rollout_session.emulator.records import ChatRecord
from rollout_session.emulator.sglang.answer import chat_response
from rollout_session.emulator.sglang.chat_message import ChatParsing, chat_skips_special_tokens
from rollout_session.emulator.sglang.generate_params import tokenizer_required
from rollout_session.emulator.sglang.replies import Invalid, check_priority, opt_int
from rollout_session.emulator.sglang.worker import reported_spans, text_ids
from rollout_session.errors import InvalidRequest
from rollout_session.prompt.messages import normalize_messages

if TYPE_CHECKING:
    from rollout_session.emulator.sglang.worker import SglangWorker

__all__ = ["handle_chat"]

# ChatCompletionRequest.separate_reasoning: bool = True (pydantic, lax).
_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


class _NoText(BadRequest):
    """``_build_chat_response`` on an answer without ``text``: the KeyError
    ``handle_request`` answers as an internal error."""

    def reply(self) -> Reply:
        message = "Internal server error: 'text'"
        return Reply(500, error_body(message, code=500, type_="InternalServerError"))


async def handle_chat(
    worker: SglangWorker,
    raw: bytes,
    fault_header: str | None,
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """One ``/v1/chat/completions`` call, counted as completed or cancelled."""
    return await worker.emulator.counted(_chat(worker, raw, fault_header, headers or {}))


async def _chat(
    worker: SglangWorker, raw: bytes, fault_header: str | None, headers: Mapping[str, str]
) -> Reply:
    emulator = worker.emulator
    arrival = trio.current_time()
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    session_id = _session_of(body) if isinstance(body, dict) else None
    try:
        fault = emulator.faults.pick(fault_header, body)
    except ValueError as exc:
        fault = None
        early: Reply | None = BadRequest(str(exc)).reply()
    else:
        early = None
    emulator.record(ChatRecord(body, arrival, fault, session_id, "chat", len(raw), headers))
    if early is not None:
        return early
    if fault is not None:
        emulator.faults_injected[fault] += 1
    if fault is not None and fault in EARLY_FAULTS:
        return await early_fault_reply(fault)
    try:
        response = await _complete(worker, body, arrival)
    except BadRequest as exc:
        return exc.reply()
    if fault is None:
        return Reply(200, orjson.dumps(response))
    return fault_reply(fault, response, emulator.model.vocab_size)


async def _complete(worker: SglangWorker, body: Any, arrival: float) -> dict[str, Any]:
    emulator = worker.emulator
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("the emulator does not stream; send stream: false")
    if body.get("n") not in (None, 1):
        raise BadRequest("n must be 1")
    # SGLang's chat route declares session_params but never passes it on
    # (serving_chat builds GenerateReqInput without it): the prompt is
    # input_ids alone, whatever session it names.
    check_priority(body)
    separate = _separate_reasoning(body)
    tools = body.get("tools") or None
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
        and all(isinstance(t["function"].get("name"), str) for t in tools)
    ):
        raise BadRequest("tools must be a list of {type: function, function: {name, ...}}")
    _check_tool_schemas(tools or ())
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    try:
        if "messages" in body:
            normalize_messages(body["messages"])  # SGLang validates them; the model reads ids
    except InvalidRequest as exc:
        raise BadRequest(exc.message) from exc
    prompt = _prompt_ids(body.get("input_ids"), emulator.model.vocab_size)
    max_tokens = opt_int(body, "max_completion_tokens", 1) or opt_int(body, "max_tokens", 1)
    cfg = emulator.config
    budget = max(1, cfg.context_length - len(prompt)) if max_tokens is None else max_tokens
    if len(prompt) + budget > cfg.context_length:
        raise BadRequest(context_length_message(cfg.context_length, len(prompt), budget))
    if not worker.has_tokenizer:
        # to_sampling_params: stop, stop_regex, min_new_tokens from the request.
        needs = tokenizer_required(
            {
                "stop": body.get("stop"),
                "stop_regex": body.get("stop_regex"),
                "min_new_tokens": body.get("min_tokens"),
            }
        )
        if needs is not None:
            raise BadRequest(needs)
    parsing = ChatParsing.of(
        body,
        tool_call_parser=worker.tool_call_parser,
        reasoning_parser=worker.reasoning_parser,
        separate_reasoning=separate,
    )
    seed = opt_int(body, "seed", -(2**63))
    sample = worker.sample(prompt, seed, budget, _chat_tool_choice(body))
    unmodelled = parsing.unmodelled(sample)
    if unmodelled is not None:
        raise BadRequest(unmodelled)
    worker.routed_experts(body, prompt, sample)  # a bad start is refused before any work

    # serving_chat passes the top-level session_id on (session_params is dropped).
    hint = body.get("session_id")
    ref = emulator.cache.session_ref(hint if isinstance(hint, str) else None)
    given_rid = body.get("rid")
    rid = given_rid if isinstance(given_rid, str) else uuid.uuid4().hex
    await emulator.weights.admit_sglang(rid)
    with emulator.weights.run(rid, "sglang") as run:
        await emulator.gpu.serve(cfg, prompt, sample.ids, ref, progress=run.progress)
    answer, spans = worker.settle(run, prompt, sample)
    cached = run.progress.cached
    emulator.count_work(len(prompt), cached)
    waiting = run.abort is not None and run.abort.waiting
    if not worker.has_tokenizer and not waiting:
        raise _NoText("the answer has no text (--skip-tokenizer-init)")
    skip = chat_skips_special_tokens(body, tools or (), worker.reasoning_parser)

    def text() -> str:
        if not worker.has_tokenizer:
            return ""  # _handle_abort_req: the state's text
        ids = answer.ids if body.get("no_stop_trim") is True else text_ids(answer)
        return worker.detokenize(prompt, ids, skip)

    return chat_response(
        answer,
        message=parsing.message(answer, text),
        reasoning_tokens=worker.reasoning_tokens(answer),
        rid=rid,
        # SGLang echoes the request's `model` ("default" when it has none).
        model=body["model"] if isinstance(body.get("model"), str) else "default",
        prompt_tokens=len(prompt),
        cached_tokens=cached,
        weight_version=spans[-1].version,
        e2e_latency=trio.current_time() - arrival,
        routed_experts=None if waiting else worker.routed_experts(body, prompt, answer),
        meta_info=body.get("return_meta_info") is True,
        weight_versions=reported_spans(spans),
        num_retractions=run.progress.retractions,
        waiting_abort=waiting,
    )


def _separate_reasoning(body: dict[str, Any]) -> bool:
    """``separate_reasoning`` (default true), read as pydantic reads it."""
    try:
        return _BOOL.validate_python(body.get("separate_reasoning", True))
    except ValidationError as exc:
        raise Invalid(f"separate_reasoning: {exc.errors(include_url=False)[0]['msg']}") from None


def _check_tool_schemas(tools: Sequence[dict[str, Any]]) -> None:
    """SGLang's ``serving_chat._validate_request`` runs jsonschema's
    ``Draft202012Validator.check_schema`` on each tool's ``parameters``: a
    schema is an object or a boolean, anything else is a 400 (a boolean one
    passes and fails later, in generation: a 500 here as there)."""
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        if parameters is not None and not isinstance(parameters, dict | bool):
            raise BadRequest(
                f"Tool {i} function has invalid 'parameters' schema: {parameters!r} is not "
                "of type 'object', 'boolean'"
            )


def _session_of(body: dict[str, Any]) -> str | None:
    """SGLang's ``session_params.id``, or a plain ``session_id`` field."""
    params = body.get("session_params")
    sid = (params.get("id") if isinstance(params, dict) else None) or body.get("session_id")
    return sid if isinstance(sid, str) and sid else None


def _prompt_ids(ids: Any, vocab: int) -> list[int]:
    """The prompt: ``input_ids`` only. SGLang would render ``messages``
    itself; a session server must never rely on that (its prompt must be
    the trajectory's ids), so the emulator refuses to."""
    if ids is None:
        raise BadRequest(
            "input_ids is required (the emulator never renders messages: the session "
            "server must send the trajectory's ids)"
        )
    if not (isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < vocab for t in ids)):
        raise BadRequest(f"input_ids must be a non-empty list of ids in [0, {vocab})")
    return ids


def _chat_tool_choice(body: dict[str, Any]) -> ToolConstraint:
    """The grammar SGLang's chat route builds from `tool_choice`, as the
    tool call it forces: "required" or a named function force a call
    (``get_json_schema_constraint``; ``parallel_tool_calls: false`` allows one),
    "auto" (the default) and "none" force nothing ("none": no call). Checked
    like ``serving_chat._validate_request``."""
    value = body.get("tool_choice")
    names = [t["function"]["name"] for t in body.get("tools") or ()]
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise BadRequest("tool_choice must name a function")
        if not names:
            raise BadRequest("Tools cannot be empty if tool choice is set to a specific tool.")
        if name not in names:
            raise BadRequest(f"Tool '{name}' not found in tools list.")
        return ToolConstraint(name, single=True)
    if value is None:
        return ToolConstraint()
    if value not in ("auto", "none", "required"):
        raise BadRequest(f"tool_choice {value!r} is not auto, none, required or a function")
    if value == "required" and not names:
        raise BadRequest("Tools cannot be empty if tool choice is set to required.")
    return ToolConstraint(
        str(value), single=value == "required" and body.get("parallel_tool_calls") is False
    )
