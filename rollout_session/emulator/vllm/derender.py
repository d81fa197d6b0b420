"""What vLLM 0.33.0's ``POST /v1/chat/completions/derender`` answers, for the emulator.

The route (``entrypoints/scale_out/derender/api_router.py``
``derender_chat_completion``; its non-streaming form here) takes a
``/inference/v1/generate`` answer of ``output_mode: "tokens"`` back and
returns the ``ChatCompletionResponse`` the chat route would have made of its
token ids: vLLM's parsers run on the text the derenderer decodes from them.
Paths under ``vllm/``; TP =
``entrypoints/scale_out/token_in_token_out/protocol.py``, DS =
``entrypoints/scale_out/derender/serving.py``, OD =
``renderers/online_derenderer.py``. In vLLM's order:

1. FastAPI: ``validate_json_request`` (``application/json`` only), then
   pydantic parses the body into the plain union ``DerenderChatRequest |
   DerenderChatStreamRequest`` (TP ``DerenderChatRequestUnion``; here the
   pydantic models of `token_protocol`): when both
   members fail, pydantic reports every error of both, each ``loc`` naming
   its member (``body.DerenderChatRequest.generate_response...``, kept by
   ``handlers/validation.py`` ``clean_loc_for_param``). ``generate_response``
   is a TP ``GenerateTokensResponse``: ``output_mode`` must be "tokens"
   (a derender- or text-mode answer is refused), logprobs carry token ids.
   ``chat_request`` is a full CP ``ChatCompletionRequest``: its "before"
   validators raise ``VLLMValidationError``, which escapes the union at once
   (a 400 ``BadRequestError``, whatever else was wrong); its fields are
   checked as on the render route (`chat_protocol`).
2. DS ``ServingDerender.derender_chat_response``: ``_check_model`` (404),
   ``_validate_derender_bounds`` (choices, ids, logprob entries, top
   logprobs and prompt logprobs against ``VLLM_MAX_N_SEQUENCES``,
   ``max_model_len`` and ``--max-logprobs``), ``_validate_prompt_token_ids``
   (the top-level ``prompt_token_ids`` only), a parser server without
   ``chat_request``; then OD ``_derender_chat``'s ``ValueError`` for a
   choice without ids. Each is a 400 ``BadRequestError`` with vLLM's text.
3. The emulator's refusals (what vLLM serves and the emulator does not
   model: streaming derender, prompt logprobs, metrics, multimodal
   placeholders, a finish reason the token route never reports (derender
   mode's "tool_calls"), ids outside its vocabulary, non-finite logprobs,
   byte-fallback logprob tokens): a 400 "the emulator does not model ...".
4. OD ``_derender_chat`` per choice: ``_decode_output`` (the stop token left
   out as the engine's detokenizer does, ``_drop_stop_token``; the text cut
   at a stop string, ``check_stop_strings``; special tokens kept whenever a
   parser runs, ``_decode_params``), the parse (``_parse_and_assemble``,
   the same function ``output_mode: "derender"`` uses; here the emulator's
   `vllm.answer.derender_message`), ``resolve_finish_reason``, the logprobs
   (``_resolve_logprobs``: ids to text, the chat route's top-logprobs cut).

The emulator has no parsers: it remembers what it sampled (`SampledAnswers`,
noted by the emulator's ``/inference/v1/generate``). A text that decodes to
a whole answer it sampled is parsed as that answer (its calls, reasoning and
content); any other text as a partial answer (`derender_message`), exactly
as the generate route's derender mode does. So a completion stitched from an
aborted answer and its continuation derenders as the uninterrupted answer.
Tool-call ids are derived from the sample (vLLM mints random ones per call).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import orjson
from pydantic import ValidationError

from rollout_session.emulator.faults import Reply
from rollout_session.emulator.vllm import token_protocol
from rollout_session.emulator.vllm.answer import Decode, Outcome, derender_message
from rollout_session.emulator.vllm.chat_protocol import Chat, chat_request
from rollout_session.emulator.vllm.errors import (
    VllmError,
    body_error,
    json_body,
    not_modelled,
    pydantic_error,
)
from rollout_session.emulator.vllm.generate import ParseContext, VllmServer
from rollout_session.emulator.vllm.names import VLLM_MAX_LOGPROBS
from rollout_session.emulator.vllm.sampling import VLLM_MAX_N_SEQUENCES

if TYPE_CHECKING:
    from rollout_session.emulator.model.generation import Sample

__all__ = ["DERENDER_PATH", "Detokenizer", "SampledAnswers", "derender_chat"]

DERENDER_PATH: Final = "/v1/chat/completions/derender"
_REPLACEMENT: Final = "\ufffd"
# v1/engine/__init__.py FINISH_REASON_STRINGS as a token-route answer carries
# them ("error" is a 500, never an answer); null reads as "stop".
_ENGINE_FINISH_REASONS: Final = (None, "stop", "length", "abort", "repetition")

# -- what the emulator knows of its tokenizer and its samples --------------------


@dataclass(frozen=True)
class Detokenizer:
    """What the derenderer reads of the served tokenizer (the emulator's)."""

    decode: Decode  # (ids, skip_special_tokens) -> text, the engine's detokenizer
    token_text: Callable[[int], str]  # one id's text in a logprob entry
    eos_token_id: int | None  # the tokenizer's EOS (renderer.get_eos_token_id)
    # generation_config.json's eos_token_id(s): OD.__init__'s model EOS ids.
    generation_eos_ids: frozenset[int]
    vocab_size: int

    @property
    def model_eos_ids(self) -> frozenset[int]:
        """OD ``_model_eos_token_ids``: generation_config's EOS ids and the tokenizer's."""
        eos = frozenset() if self.eos_token_id is None else frozenset({self.eos_token_id})
        return self.generation_eos_ids | eos


class SampledAnswers:
    """The answers the emulator's vLLM generate route sampled, found by the
    text vLLM's derenderer decodes from them (special tokens kept, the end
    token left out): text → the sample's parsed message (``Sample.message``).

    Bounded (``entries`` samples, least recently used out); samples are
    decoded only when a derender first needs them, so serving without
    derender calls costs nothing.
    """

    def __init__(self, decode: Decode, *, entries: int = 4096) -> None:
        self._decode = decode
        self._entries = entries
        self._pending: deque[tuple[list[int], Mapping[str, Any]]] = deque(maxlen=entries)
        self._by_text: OrderedDict[str, Mapping[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        self._index()
        return len(self._by_text)

    def note(self, sample: Sample) -> None:
        """Remember a sample: its whole answer (the model's end token left
        out, as the generate route's text leaves it) and its parsed message."""
        finish = sample.finish
        ended = finish.get("type") == "stop" and isinstance(finish.get("matched"), int)
        self._pending.append((list(sample.ids[:-1] if ended else sample.ids), sample.message))

    def find(self, text: str) -> Mapping[str, Any] | None:
        """The parsed message of the sampled answer whose text is ``text``."""
        self._index()
        message = self._by_text.get(text)
        if message is not None:
            self._by_text.move_to_end(text)
        return message

    def _index(self) -> None:
        while self._pending:
            ids, message = self._pending.popleft()
            text = self._decode(ids, False)
            self._by_text.pop(text, None)
            self._by_text[text] = message
            while len(self._by_text) > self._entries:
                self._by_text.popitem(last=False)


# -- stage 1: pydantic ------------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    """TP ``DerenderChatRequest`` after stage 1."""

    model: str | None
    response: dict[str, Any]  # generate_response's fields (GenerateTokensResponse)
    prompt_tokens: int | None
    prompt_token_ids: list[int] | None
    chat: Chat | None


def _parse_body(body: Any) -> _Request:
    """Stage 1: FastAPI + pydantic over TP ``DerenderChatRequestUnion``
    (`token_protocol`); streaming derender is not modelled."""
    if isinstance(body, dict) and body.get("stream") is True:
        raise not_modelled(
            f"streaming derender (stream: true on {DERENDER_PATH}): send stream: false", "stream"
        )
    try:
        request = token_protocol.DERENDER_BODY(body)
    except ValidationError as exc:
        if isinstance(body, dict) and (
            "generate_chunk" in body or body.get("stream_state") is not None
        ):
            raise not_modelled(
                "streaming derender (generate_chunk, stream_state): send a non-streaming body",
                "generate_chunk",
            ) from None
        raise pydantic_error(exc) from None
    if isinstance(request, token_protocol.DerenderChatStreamRequest):
        raise not_modelled(
            f"streaming derender (stream: true on {DERENDER_PATH}): send stream: false", "stream"
        )
    chat = request.chat_request
    return _Request(
        model=request.model,
        response=request.generate_response.model_dump(),
        prompt_tokens=request.prompt_tokens,
        prompt_token_ids=request.prompt_token_ids,
        chat=None if chat is None else chat_request(chat),
    )


# -- stage 2: ServingDerender ------------------------------------------------------


def _serve_checks(request: _Request, server: VllmServer) -> None:
    """DS ``derender_chat_response`` before the derender, in its order."""
    if request.model and request.model != server.model_name:  # BaseServing._check_model
        raise VllmError(
            f"The model `{request.model}` does not exist. Valid aliases: {server.model_name}.",
            type_="NotFoundError",
            code=404,
            param="model",
        )
    gen = request.response
    max_len = server.context_length
    choices: list[dict[str, Any]] = gen["choices"]
    # DS _validate_derender_bounds (one generate response).
    if len(choices) > VLLM_MAX_N_SEQUENCES:
        raise VllmError(
            f"choices count ({len(choices)}) in response '{gen['request_id']}' exceeds server "
            f"maximum ({VLLM_MAX_N_SEQUENCES})."
        )
    for choice in choices:
        index, ids = choice["index"], choice["token_ids"]
        if ids and len(ids) > max_len:
            raise VllmError(
                f"token_ids length ({len(ids)}) in choice {index} exceeds max_model_len "
                f"({max_len})."
            )
        content = (choice["logprobs"] or {}).get("content")
        if not content:
            continue
        if len(content) > max_len:
            raise VllmError(
                f"logprobs.content length ({len(content)}) in choice {index} exceeds "
                f"max_model_len ({max_len})."
            )
        for entry in content:
            top = entry["top_logprobs"]
            if top and len(top) > VLLM_MAX_LOGPROBS:
                raise VllmError(
                    f"top_logprobs count ({len(top)}) in choice {index} exceeds max_logprobs "
                    f"({VLLM_MAX_LOGPROBS})."
                )
    prompt_logprobs = gen["prompt_logprobs"]
    if prompt_logprobs and len(prompt_logprobs) > max_len:
        raise VllmError(
            f"prompt_logprobs length ({len(prompt_logprobs)}) in response "
            f"'{gen['request_id']}' exceeds max_model_len ({max_len})."
        )
    # DS _validate_prompt_token_ids: the top-level list only.
    prompt_ids = request.prompt_token_ids
    if prompt_ids is not None and len(prompt_ids) > max_len:
        raise VllmError(
            f"prompt_token_ids length ({len(prompt_ids)}) exceeds max_model_len ({max_len})."
        )
    if server.has_parser and request.chat is None:
        raise VllmError(
            "chat_request is required when a tool or reasoning parser is configured because "
            "plain detokenization would leak raw parser markup into content."
        )
    # OD _derender_chat's ValueError, raised at the first choice without ids.
    for choice in choices:
        if not choice["token_ids"]:
            raise VllmError(f"choice {choice['index']} has empty or null token_ids")


# -- stage 3: the emulator's refusals ------------------------------------------------


def _emulator_refusals(request: _Request, detok: Detokenizer) -> None:
    gen = request.response
    for name in ("prompt_logprobs", "mm_placeholders", "metrics"):
        if gen[name] is not None:
            raise not_modelled(f"generate_response.{name} on {DERENDER_PATH}", name)
    vocab = detok.vocab_size
    for choice in gen["choices"]:
        reason = choice["finish_reason"]
        if reason not in _ENGINE_FINISH_REASONS:
            # vLLM would decode the end token into the text and parse that.
            raise not_modelled(
                f"finish_reason {reason!r} in generate_response (the token route reports "
                "stop, length, abort or repetition; derender mode's tool_calls was stop)",
                "finish_reason",
            )
        ids = list(choice["token_ids"])
        content = (choice["logprobs"] or {}).get("content") or []
        values: list[float] = []
        for entry in content:
            ids.append(entry["token_id"])
            values.append(entry["logprob"])
            for top in entry["top_logprobs"]:
                ids.append(top["token_id"])
                values.append(top["logprob"])
        outside = sorted({t for t in ids if t >= vocab})
        if outside:
            raise not_modelled(
                f"token ids outside its vocabulary of {vocab} (got {outside[:5]})", "token_ids"
            )
        if not all(math.isfinite(v) for v in values):
            # vLLM passes logprobs through; JSON cannot carry these.
            raise not_modelled("non-finite logprobs in generate_response", "logprobs")
        if any(detok.token_text(t).endswith(_REPLACEMENT) for t in ids[len(choice["token_ids"]) :]):
            raise not_modelled(
                "byte-fallback logprob tokens (OD _correct_decoded_token)", "logprobs"
            )


# -- stage 4: the derender ---------------------------------------------------------


def _check_stop_strings(
    text: str, new_chars: int, stops: Sequence[str], include: bool
) -> tuple[str, int] | None:
    """``v1/engine/detokenizer.py`` ``check_stop_strings``: the stop string
    completing earliest in the last ``new_chars`` characters (ties: list
    order), and where the text ends: -1 (uncut), or its cut."""
    if not new_chars or not stops:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start >= 0 and (best is None or start + len(stop) < best[0]):
            best = (start + len(stop), start, stop)
    if best is None:
        return None
    end, start, stop = best
    if include:
        return stop, -1 if end >= len(text) else end
    return stop, start


def _decode_output(
    choice: Mapping[str, Any],
    chat: Chat | None,
    detok: Detokenizer,
    skip_special: bool,
) -> tuple[str, int | str | None]:
    """OD ``_decode_output``: the text the engine would have returned for the
    ids, and the ``stop_reason``."""
    ids: list[int] = choice["token_ids"]
    finish_reason: str | None = choice["finish_reason"]
    reported = stop_reason = choice["stop_reason"]
    f = chat.f if chat is not None else None
    include = f is not None and bool(f["include_stop_str_in_output"])
    # OD _drop_stop_token
    if finish_reason == "stop" and not isinstance(reported, str) and ids:
        last = ids[-1]
        if reported is None:
            honor_eos = f is None or not f["ignore_eos"]
            stop_ids = (f["stop_token_ids"] or []) if f is not None else []
            if honor_eos and last == detok.eos_token_id:
                stopped = True
            elif last in stop_ids or (honor_eos and last in detok.model_eos_ids):
                stopped, stop_reason = True, last
            else:
                stopped = False
        else:
            stopped = last == reported
        if stopped and not include:
            ids = ids[:-1]
    if finish_reason != "stop" or isinstance(reported, int):
        stops: list[str] = []
    elif isinstance(reported, str):
        stops = [reported]
    else:  # OD _stop_strings: the request's stop, as SamplingParams keeps it
        raw = f["stop"] if f is not None else None
        stops = [raw] if isinstance(raw, str) and raw else [s for s in raw or () if s]
    min_tokens = f["min_tokens"] if f is not None else 0
    head = detok.decode(ids[:min_tokens], skip_special) if min_tokens > 0 else ""
    text = detok.decode(ids, skip_special)
    match = _check_stop_strings(text, len(text) - len(head), stops, include)
    if match is None:
        return text, stop_reason
    stop, cut = match
    return (text if cut == -1 else text[:cut]), stop


def _history_tool_calls(messages: Sequence[Any]) -> int:
    """``parser/utils.py`` ``count_chat_history_tool_calls``: the calls of the
    assistant messages (a string or object counts as one)."""
    count = 0
    for message in messages:
        if not (isinstance(message, dict) and message.get("role") == "assistant"):
            continue
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if isinstance(calls, str | bytes | dict) or not isinstance(calls, list | tuple):
            count += 1
        else:
            count += len(calls)
    return count


def _parse_context(chat: Chat) -> ParseContext:
    """What the parse reads of the chat request, as the generate route's
    ``ParseContext`` carries it (the history counted from its messages, as
    ``DelegatingParser._initialize_history_tool_call_cnt`` does)."""
    f = chat.f
    named = chat.named
    tools = f["tools"]
    return ParseContext(
        tools=None if tools is None else tuple(tools),
        tool_choice=None if named is not None else f["tool_choice"],
        named=named,
        parallel_tool_calls=f["parallel_tool_calls"],
        include_reasoning=f["include_reasoning"],
        chat_template_kwargs=dict(f["chat_template_kwargs"] or {}),
        history_tool_call_cnt=_history_tool_calls(chat.messages),
    )


def _top_limit(chat: Chat | None) -> int | None:
    """OD ``_chat_top_logprobs_limit`` (``chat_top_logprobs_limit``): None keeps
    every candidate."""
    if chat is None or not chat.f["logprobs"]:
        return None
    top = chat.f["top_logprobs"]
    if chat.f["logprob_token_ids"] or top == -1:
        return None
    return int(top or 0)


def _resolve_logprobs(
    logprobs: Mapping[str, Any], limit: int | None, detok: Detokenizer
) -> dict[str, Any]:
    """OD ``_resolve_logprobs``: ids to the chat shape, values passed through."""
    content = logprobs["content"]
    if content is None:
        return {"content": None}

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = detok.token_text(token_id)
        return {
            "token": text,
            "logprob": logprob,
            "bytes": list(text.encode("utf-8", "replace")),
        }

    resolved = []
    for item in content:
        top = item["top_logprobs"] if limit is None else item["top_logprobs"][:limit]
        resolved.append(
            {
                **entry(item["token_id"], item["logprob"]),
                "top_logprobs": [entry(t["token_id"], t["logprob"]) for t in top],
            }
        )
    return {"content": resolved}


def _derender(
    request: _Request, server: VllmServer, detok: Detokenizer, answers: SampledAnswers
) -> dict[str, Any]:
    """OD ``_derender_chat`` and DS's ``ChatCompletionResponse``."""
    chat = request.chat
    gen = request.response
    parsed = server.has_parser and chat is not None
    # OD _decode_params: a parser sees special tokens; else the request's choice.
    skip_special = not parsed and (chat is None or chat.f["skip_special_tokens"] is not False)
    context = _parse_context(chat) if parsed and chat is not None else None
    hide = context is not None and not context.include_reasoning
    return_ids = chat is not None and bool(chat.f["return_token_ids"]) and not hide
    limit = _top_limit(chat)
    choices = []
    for choice in gen["choices"]:
        text, stop_reason = _decode_output(choice, chat, detok, skip_special)
        sampled = answers.find(text) if context is not None else None
        outcome = Outcome(
            ids=list(choice["token_ids"]),
            logprobs=[],
            # resolve_finish_reason: a missing finish reason is "stop".
            finish_reason=choice["finish_reason"] or "stop",
            stop_reason=stop_reason,
            text=text,
            whole=sampled is not None,
        )
        message, finish_reason = derender_message(outcome, sampled or {}, server, context)
        logprobs = choice["logprobs"]
        choices.append(
            {
                "index": choice["index"],
                "message": message,
                "logprobs": None
                if logprobs is None or hide
                else _resolve_logprobs(logprobs, limit, detok),
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": list(choice["token_ids"]) if return_ids else None,
                "routed_experts": None,
                "weight_versions": None,
            }
        )
    prompt_tokens = request.prompt_tokens if request.prompt_tokens is not None else 0
    completion_tokens = sum(len(c["token_ids"]) for c in gen["choices"] if c["token_ids"])
    return {
        "id": gen["request_id"],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model or server.model_name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": gen["prompt_logprobs"],
        "prompt_token_ids": gen["prompt_token_ids"]
        if chat is not None and chat.f["return_token_ids"]
        else None,
        "prompt_text": None,
        "kv_transfer_params": gen["kv_transfer_params"],
        "ec_transfer_params": None,
        "metrics": gen["metrics"],
    }


def derender_chat(
    raw: bytes,
    content_type: str,
    server: VllmServer,
    detok: Detokenizer,
    answers: SampledAnswers,
) -> Reply:
    """One non-streaming ``POST /v1/chat/completions/derender``: vLLM's
    ``ChatCompletionResponse`` (200), or its error body, in vLLM's order
    (module docstring). ``content_type`` is the request's header."""
    try:
        # validate_json_request: the header lowercased, cut at ";" (not stripped).
        if content_type.lower().split(";", 1)[0] != "application/json":
            raise body_error(["Unsupported Media Type: Only 'application/json' is allowed"])
        request = _parse_body(json_body(raw))
        _serve_checks(request, server)
        _emulator_refusals(request, detok)
        answer = _derender(request, server, detok, answers)
    except VllmError as exc:
        return exc.reply()
    return Reply(200, orjson.dumps(answer))
