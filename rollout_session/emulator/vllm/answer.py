"""What vLLM 0.33.0 answers on ``POST /inference/v1/generate``, from the emulator's sample.

Paths under ``vllm/``; TP = ``entrypoints/scale_out/token_in_token_out/protocol.py``,
TS = its ``serving.py``, OD = ``renderers/online_derenderer.py``.

- `json_tool_constraint`: the tool call a ``structured_outputs.json`` schema
  forces (the one ``tool_parsers/utils.py`` ``get_json_schema_from_tools``
  builds for ``tool_choice`` "required", or a named tool's parameters), or
  the emulator's own structural tag (`vllm.tag`).
- `finish`: where the engine stops the model's answer: its end token (EOS,
  ``stop_reason`` null), ``stop_token_ids`` (generation_config's extra EOS
  ids included, as ``SamplingParams.update_from_generation_config`` adds
  them), a stop string (``v1/engine/detokenizer.py``: the text cut before it
  unless ``include_stop_str_in_output``, ``stop_reason`` the string),
  ``max_tokens`` or the context (``v1/core/sched/utils.py`` ``check_stop``:
  "length"), or an abort ("abort", the tokens so far). The text excludes a
  final stop token unless ``include_stop_str_in_output``.
- `derender_message`: OD ``_derender_text_choices`` for the emulator's
  answer: the parsed message its sample carries (``Sample.message``), cut
  down to what the server's parsers and the request's ``parse_context``
  keep (``entrypoints/openai/chat_completion/message_assembly.py``
  ``assemble_chat_message_fields``), and the finish reason
  (``entrypoints/serve/utils/tool_calls_utils.py`` ``resolve_finish_reason``).
- `generate_answer`: TS ``serve_tokens_full_generator`` and
  ``_build_response_fields``: ``GenerateTokensResponse``,
  ``GenerateTextResponse`` or ``GenerateDerenderResponse``, fields in the
  pydantic models' order.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np

from rollout_session.emulator.model.forced_call import ToolConstraint, array_tool_constraint
from rollout_session.emulator.model.logprobs import rank_of
from rollout_session.emulator.model.routed_experts import routed_experts
from rollout_session.emulator.vllm.errors import VllmError, not_modelled
from rollout_session.emulator.vllm.generate import GenerateRequest, ParseContext, VllmServer
from rollout_session.emulator.vllm.names import KIMI_TOOL_PARSERS
from rollout_session.emulator.vllm.sampling import Sampling
from rollout_session.emulator.vllm.tag import read_tag, tag_constraint

__all__ = [
    "Outcome",
    "derender_message",
    "finish",
    "generate_answer",
    "json_tool_constraint",
    "routed_experts_npy",
]

_THINK: Final = ("<think>", "</think>")
# `tool_parsers/utils.py` `_params_or_empty_object`: a tool without parameters.
_EMPTY_OBJECT: Final = {"type": "object", "properties": {}}


# -- the constraint ----------------------------------------------------------


def json_tool_constraint(
    constraint: tuple[str, Any] | None, context: ParseContext | None
) -> ToolConstraint:
    """The tool call ``structured_outputs`` forces. ``{"json": schema}`` with
    the array schema of ``tool_choice`` "required" (``items.anyOf``;
    ``maxItems: 1`` when ``parallel_tool_calls`` is false) forces a call of
    some offered tool; a schema equal to one of ``parse_context.tools``'
    parameters (the named ``tool_choice`` first) forces that function (the
    schema ``ToolParser.adjust_request`` writes for a named tool). Any other
    schema, and ``json_object``, force nothing: a response format, answered
    as the model answers (it has no JSON mode). A structural tag the
    emulator's render route minted forces what it says (`vllm.tag`; foreign
    tags never get here: `vllm.generate` refuses them)."""
    if constraint is not None and constraint[0] == "structural_tag":
        tag = read_tag(constraint[1])
        return ToolConstraint() if tag is None else tag_constraint(tag)
    if constraint is None or constraint[0] != "json":
        return ToolConstraint()
    schema = constraint[1]
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise VllmError(
                f"the emulator cannot read structured_outputs.json as a JSON schema: {exc}",
                param="structured_outputs",
            ) from None
    if not isinstance(schema, dict):
        return ToolConstraint()
    forced = array_tool_constraint(schema)
    if forced is not None:
        return forced
    if context is None or not context.tools:
        return ToolConstraint()
    functions = [t["function"] for t in context.tools]
    functions.sort(key=lambda f: f["name"] != context.named)  # the named tool first
    for function in functions:
        if (function.get("parameters") or _EMPTY_OBJECT) == schema:
            return ToolConstraint(str(function["name"]), single=True)
    return ToolConstraint()


# -- where generation ends -----------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What the engine returns of the model's answer."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None
    text: str  # output.text ("" when not detokenized)
    # The text is the whole answer's: its parsed message (Sample.message) applies.
    whole: bool


Decode = Callable[[Sequence[int], bool], str]


def finish(
    ids: Sequence[int],
    logprobs: Sequence[float],
    ended: bool,
    sampling: Sampling,
    budget: int,
    decode: Decode,
    eos_id: int | None,
    extra_eos: frozenset[int],
) -> Outcome:
    """Where vLLM stops the answer ``ids`` (``ended``: its last id is the
    model's end token). Raises `VllmError` where ``min_tokens`` would have
    masked an end the model sampled (vLLM would have sampled something
    else: not modelled)."""
    s = sampling
    stop_ids = set(s.stop_token_ids) | (extra_eos - {eos_id})
    skip = s.skip_special_tokens
    pieces: list[str] = []
    longest = max((len(x) for x in s.stop), default=0)
    for k in range(1, len(ids) + 1):
        token = ids[k - 1]
        terminal = token == eos_id or token in stop_ids or (ended and k == len(ids))
        if terminal and k <= s.min_tokens:
            raise not_modelled(
                f"min_tokens={s.min_tokens} past its answer's end (token {k})", "min_tokens"
            )
        if terminal:
            reason = None if token == eos_id else token
            return _outcome(ids[:k], logprobs, "stop", reason, decode, s, stop_token=True)
        if s.stop and s.detokenize:
            pieces.append(decode([token], skip))
            if k > s.min_tokens:
                seen = "".join(pieces)
                found = _stop_string(seen, len(pieces[-1]), s.stop, longest)
                if found is not None:
                    return _stop_string_outcome(ids[:k], logprobs, found, decode, s)
        if k >= budget:
            return _outcome(ids[:k], logprobs, "length", None, decode, s, stop_token=False)
    return _outcome(list(ids), logprobs, "stop", None, decode, s, stop_token=False)


def _stop_string(text: str, new: int, stops: Sequence[str], longest: int) -> str | None:
    """``check_stop_strings``: the stop string completing earliest in the new text."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, len(text) - new - longest + 1))
        if at >= 0 and (best is None or at + len(stop) < best[0]):
            best = (at + len(stop), stop)
    return None if best is None else best[1]


def _stop_string_outcome(
    ids: Sequence[int], logprobs: Sequence[float], stop: str, decode: Decode, s: Sampling
) -> Outcome:
    text = decode(ids, s.skip_special_tokens)
    at = text.find(stop)
    text = text[: at + len(stop)] if s.include_stop_str_in_output else text[:at]
    return Outcome(list(ids), list(logprobs[: len(ids)]), "stop", stop, text, whole=False)


def _outcome(
    ids: Sequence[int],
    logprobs: Sequence[float],
    reason: str,
    stop_reason: int | str | None,
    decode: Decode,
    s: Sampling,
    *,
    stop_token: bool,
) -> Outcome:
    shown = ids[:-1] if stop_token and not s.include_stop_str_in_output else ids
    text = decode(shown, s.skip_special_tokens) if s.detokenize else ""
    return Outcome(list(ids), list(logprobs[: len(ids)]), reason, stop_reason, text, whole=False)


def mark_whole(outcome: Outcome, whole_text: str) -> Outcome:
    """The outcome, marked whole when its text is the whole answer's."""
    return replace(outcome, whole=outcome.text == whole_text)


def aborted(outcome: Outcome, tokens: int, decode: Decode, s: Sampling, whole_text: str) -> Outcome:
    """An abort after ``tokens`` of the answer: "abort", the tokens so far
    (``OutputProcessor.abort_requests``; ``stop_reason`` null)."""
    ids = outcome.ids[: max(0, tokens)]
    text = decode(ids, s.skip_special_tokens) if s.detokenize else ""
    return Outcome(ids, outcome.logprobs[: len(ids)], "abort", None, text, text == whole_text)


# -- the derendered message ------------------------------------------------------


def _after_reasoning(text: str, reasoning: str) -> str:
    """The text after the reasoning block (and the ``</think>`` closing it)."""
    at = text.find(reasoning)
    if at < 0:
        return text
    rest = text[at + len(reasoning) :]
    if _THINK[1] in rest:
        rest = rest.split(_THINK[1], 1)[1]
    return rest.lstrip()


def _split_think(text: str) -> tuple[str | None, str | None]:
    """A ``<think>`` reasoning parser on a partial answer (``reasoning/
    basic_parsers.py`` ``BaseThinkingReasoningParser.extract_reasoning``,
    whitespace stripped): before ``</think>`` is reasoning; an unclosed
    block is all reasoning; no marker at all is all content (the emulator's
    model did not reason)."""
    start, end = _THINK
    body = text.partition(start)[2] if start in text else text
    if end in body:
        reasoning, _, content = body.partition(end)
        return reasoning.strip() or None, content.strip() or None
    if start in text:
        return body.strip() or None, None
    return None, text


def _call_id(parser: str | None, call: Mapping[str, Any], index: int) -> str:
    """``ToolCall.id``: Kimi's ``functions.NAME:IDX`` (IDX from
    ``history_tool_call_cnt``), Mistral's own 9 alphanumerics (the sampled
    call's), else ``chatcmpl-tool-`` + 16 hex (``make_tool_call_id``; vLLM's
    are random, the emulator's derived from the sample)."""
    name = call["function"]["name"]
    if parser in KIMI_TOOL_PARSERS:
        return f"functions.{name}:{index}"
    if parser == "mistral":
        return str(call["id"])
    digest = hashlib.blake2b(f"{call['id']}:{index}".encode(), digest_size=8).hexdigest()
    return f"chatcmpl-tool-{digest}"


def derender_message(
    outcome: Outcome,
    message: Mapping[str, Any],
    server: VllmServer,
    context: ParseContext | None,
) -> tuple[dict[str, Any], str]:
    """OD ``_derender_text_choices`` for one answer: (``ChatMessage``, finish reason).

    ``message`` is the sample's parsed message (content, ``reasoning_content``,
    ``tool_calls``), used when the outcome is the whole answer; a partial
    answer (cut by ``max_tokens``, a stop string, an abort) is parsed from
    its text: ``<think>`` reasoning split off, no tool call (a parser finds
    no complete call in it).
    """
    text = outcome.text
    if context is None:  # no parser on the server: the text is the content
        return _chat_message(text, [], None), outcome.finish_reason
    tool_parser, reasoning_parser = server.tool_call_parser, server.reasoning_parser
    calls: list[Mapping[str, Any]] = []
    beside = ""  # the text a tool parser leaves beside its calls
    reasoning: str | None = None
    content: str | None = text
    if outcome.whole:
        thought = message.get("reasoning_content") or None
        calls = list(message.get("tool_calls") or ())
        after = _after_reasoning(text, thought) if thought else text
        if reasoning_parser is not None and thought:
            reasoning = thought
            # the base parser's `content or None` after the reasoning
            content = (after if calls else str(message.get("content") or "")) or None
        if calls:
            beside = str(message.get("content") or "")
            if thought and reasoning_parser is None:  # the reasoning block is text too
                beside = text[: len(text) - len(after)].strip() + beside
    elif reasoning_parser is not None:
        reasoning, content = _split_think(text)
    # DelegatingParser._extract_tool_calls: only a tool parser extracts, and
    # not under tool_choice "none"; every parser is taken to fall back to its
    # own extraction for required/named (VLLM_ENFORCE_STRICT_TOOL_CALLING).
    if tool_parser is not None and context.tool_choice != "none" and calls:
        content = beside if beside and beside.strip() else None
    else:
        calls = []
        if context.forced and not (content or "").strip():
            content = None
    # assemble_chat_message_fields
    if not context.include_reasoning:
        reasoning = None
    keeps = context.forced or (
        tool_parser is not None and context.tool_choice == "auto" and bool(context.tools)
    )
    if not keeps:
        calls = []
    elif context.forced:
        content = content or ""
    if context.parallel_tool_calls is False:
        calls = calls[:1]
    tool_calls = [
        {
            "id": _call_id(tool_parser, call, context.history_tool_call_cnt + i),
            "type": "function",
            "function": {
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            },
        }
        for i, call in enumerate(calls)
    ]
    reason = outcome.finish_reason
    if tool_calls and reason == "stop" and context.named is None:
        reason = "tool_calls"
    return _chat_message(content, tool_calls, reasoning), reason


def _chat_message(
    content: str | None, tool_calls: list[dict[str, Any]], reasoning: str | None
) -> dict[str, Any]:
    """``ChatMessage`` as it serialises: ``tool_calls`` only when non-empty."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    message["reasoning"] = reasoning
    return message


# -- the answer ----------------------------------------------------------------


def routed_experts_npy(
    token_ids: Sequence[int], start: int, *, layers: int, top_k: int, num_experts: int
) -> str:
    """``utils/serial_utils.py`` ``numpy2base64``: base64 of the ``.npy`` file
    (``np.save``) of shape ``(rows, layers, top_k)``, dtype uint8 for at most
    256 experts, else uint16 (``routed_experts_capturer.py``)."""
    experts = routed_experts(token_ids, start, layers=layers, top_k=top_k, num_experts=num_experts)
    buffer = io.BytesIO()
    np.save(
        buffer, experts.astype(np.uint8 if num_experts <= 256 else np.uint16), allow_pickle=False
    )
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _logprobs(
    mode: str, ids: Sequence[int], logprobs: Sequence[float], token: Callable[[int], str]
) -> dict[str, Any]:
    """tokens: ``GenerateLogProbs`` (ids, rank; the engine's candidates, the
    sampled token first); text: ``ChatCompletionLogProbs`` with every
    candidate; derender: the chat cut (``chat_top_logprobs_limit``: none for
    ``logprobs`` 0). The emulator's only candidate is the sampled token, of
    the rank its logprob allows (`logprobs.rank_of`, as its prompt logprobs)."""
    content: list[dict[str, Any]] = []
    for tok, lp in zip(ids, logprobs, strict=True):
        if mode == "tokens":
            top = {"token_id": tok, "logprob": lp, "rank": rank_of(lp)}
            content.append({**top, "top_logprobs": [top]})
            continue
        text = token(tok)
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}
        content.append({**entry, "top_logprobs": [entry] if mode == "text" else []})
    return {"content": content}


def generate_answer(
    *,
    request: GenerateRequest,
    request_id: str,
    model: str,
    outcome: Outcome,
    prompt_tokens: int,
    cached_tokens: int | None,
    routed: str | None,
    weight_versions: list[dict[str, Any]],
    message: tuple[dict[str, Any], str] | None,
    hide_metadata: bool,
    token: Callable[[int], str],
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None,
) -> dict[str, Any]:
    """The non-streaming answer (``GenerateResponseBase`` fields, then
    ``output_mode``, then ``choices``); ``cached_tokens`` None: no
    ``prompt_tokens_details`` (without --enable-prompt-tokens-details);
    ``weight_versions``: the output's spans (``CompletionOutput.weight_versions``:
    ``output_processor.py`` ``_weight_version_spans``, [] without tokens);
    ``prompt_logprobs``: the request's (``_build_response_fields``), None
    unless it asked for them."""
    n = len(outcome.ids)
    mode = request.output_mode
    logprobs = (
        _logprobs(mode, outcome.ids, outcome.logprobs, token)
        if request.sampling.logprobs is not None
        else None
    )
    finish_reason = outcome.finish_reason if message is None else message[1]
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish_reason,
        "stop_reason": outcome.stop_reason,
        "token_ids": list(outcome.ids),
        "routed_experts": routed,
        "sampling_mask": None,
        "weight_versions": weight_versions,
    }
    if mode == "text":
        choice["text"] = outcome.text
    elif mode == "derender":
        assert message is not None
        choice["message"] = message[0]
        if hide_metadata:  # include_reasoning false hides per-token metadata
            logprobs = None
            choice["token_ids"] = None
    choice["logprobs"] = logprobs
    details = (
        None
        if cached_tokens is None
        else {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }
    )
    return {
        "request_id": request_id,
        "model": model,
        "created": int(time.time()),
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + n,
            "completion_tokens": n,
            "prompt_tokens_details": details,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": list(request.token_ids) if request.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": mode,
        "choices": [choice],
    }
