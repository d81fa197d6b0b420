"""SGLang 0.5.23's native ``POST /generate``, non-streaming, ``input_ids`` only.

Models, in SGLang's order: FastAPI's parse of ``GenerateReqInput``
(`io_struct`) and the contract gate (`contract_gate`), then ``srt/managers/
tokenizer_manager.py`` ``TokenizerManager._validate_one_request`` (the
lengths), ``SamplingParams.verify`` (`generate_params.sampling_error`),
the scheduler's ``_handle_generate_request`` (``logprob_start_len``), the
session controller (``session_params``: `sessions`) and the answer's
``meta_info`` (``_handle_batch_output``; ``_handle_abort_req`` for a
request aborted in the waiting queue). What SGLang would serve and the
emulator cannot is refused, never faked.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import orjson
import trio

from rollout_session.emulator.faults import BadRequest, Reply, context_length_message
from rollout_session.emulator.model.generation import Sample
from rollout_session.emulator.records import ChatRecord
from rollout_session.emulator.sglang.contract_gate import contract_error
from rollout_session.emulator.sglang.generate_params import (
    sampling_error,
    structural_tag_constraint,
    tool_constraint,
)
from rollout_session.emulator.sglang.io_struct import check_generate, lax_true
from rollout_session.emulator.sglang.replies import Invalid, check_priority, generate_error
from rollout_session.emulator.sglang.sessions import SessionError, SessionTurn
from rollout_session.emulator.sglang.worker import reported_spans, text_ids
from rollout_session.emulator.weights import Run, Span

if TYPE_CHECKING:
    from rollout_session.emulator.sglang.worker import SglangWorker

__all__ = ["handle_generate"]

# SamplingParams.max_new_tokens's default (a /generate request without it).
_GENERATE_MAX_NEW_TOKENS: Final = 128
# tokenizer_manager.py _tokenize_one_request, with no tokenizer (--skip-tokenizer-init).
_TEXT_WITHOUT_TOKENIZER: Final = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)
# Keys a batched /generate request makes lists of (the emulator serves one request per call).
_BATCH_KEYS: Final = (
    "rid", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_hidden_states", "lora_path", "custom_logit_processor",
)  # fmt: skip


async def handle_generate(worker: SglangWorker, raw: bytes) -> Reply:
    """One ``/generate`` call, counted as completed or cancelled."""
    return await worker.emulator.counted(_generate(worker, raw))


async def _generate(worker: SglangWorker, raw: bytes) -> Reply:
    arrival = trio.current_time()
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    params = body.get("session_params") if isinstance(body, dict) else None
    sid = params.get("id") if isinstance(params, dict) else None
    worker.emulator.record(
        ChatRecord(body, arrival, None, sid if isinstance(sid, str) else None, "generate", len(raw))
    )
    try:
        return await _generate_checked(worker, body, arrival)
    except Invalid as exc:
        return exc.reply()
    except BadRequest as exc:
        return generate_error(str(exc))
    except SessionError as exc:
        return generate_error(str(exc))


async def _generate_checked(worker: SglangWorker, body: Any, arrival: float) -> Reply:
    emulator = worker.emulator
    cfg = emulator.config
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    # SGLang's order: FastAPI's parse (io_struct), the contract gate
    # (contract_gate), then the tokenizer manager's checks (generate_params).
    check_generate(body)
    contract = contract_error(body)
    if contract is not None:
        return Reply(400, orjson.dumps({"error": contract}))
    if body.get("stream"):
        raise BadRequest("the emulator does not stream; send stream: false")
    requested: dict[str, Any] = body.get("sampling_params") or {}
    # What SamplingParams is built from (--preferred-sampling-params under the request's).
    sampling = worker.sampling_params(requested)
    _refuse_unmodelled(body, sampling, worker.has_tokenizer)
    params = body.get("session_params")
    if body.get("session_id") is not None and params is not None:
        raise BadRequest("session_id and session_params cannot both be set.")
    ids = body.get("input_ids")
    vocab = emulator.model.vocab_size
    if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids)):
        raise BadRequest(
            f"input_ids must be a list of ids in [0, {vocab}) (the emulator never tokenizes text)"
        )
    if not ids and not (params and params.get("id")):
        raise BadRequest("input_ids cannot be empty.")
    # Omitted: SamplingParams' default 128; null: no limit (the context).
    max_new: int | None = sampling.get("max_new_tokens", _GENERATE_MAX_NEW_TOKENS)
    # Checked only when sent (the tokenizer manager reads the request's dict).
    _check_lengths(cfg.context_length, len(ids), requested.get("max_new_tokens"))
    error = sampling_error(sampling, vocab, skip_tokenizer_init=not worker.has_tokenizer)
    if error is not None:
        raise BadRequest(error)
    if max_new == 0:  # prefill only (Req.is_prefill_only): the prompt's logprobs
        if params is not None and params.get("id") is not None:
            raise BadRequest(
                "the emulator does not model prefill-only requests (max_new_tokens 0) "
                "in a session (session_params)"
            )
        if lax_true(body.get("return_routed_experts")):
            raise BadRequest(
                "the emulator does not model routed experts of a prefill-only request "
                "(max_new_tokens 0)"
            )
    check_priority(body)
    given_rid = body.get("rid")
    rid = given_rid if isinstance(given_rid, str) else uuid.uuid4().hex
    emulator.reap()
    turn: SessionTurn | None = None
    prompt: list[int] = ids
    if params is not None and params.get("id") is not None:
        # Non-streaming sessions keep output[:max_new_tokens] (no limit: all).
        kept = max_new if max_new is not None else cfg.context_length
        turn = emulator.sessions.create(params, rid, ids, kept, emulator.now())
        prompt = turn.turn.context
        emulator.sessions_changed()  # tests wait for the turn to be in flight
    try:
        sample, run = await _run(worker, body, sampling, prompt, turn, max_new, rid)
    except BaseException:
        if turn is not None:
            emulator.sessions.abort(turn)
            emulator.sessions_changed()
        raise
    answer, spans = worker.settle(run, prompt, sample)
    if turn is not None:
        if run.abort is None:
            emulator.sessions.finish(turn, sample.ids)
        else:  # an aborted turn is not appended to its session
            emulator.sessions.abort(turn)
        emulator.sessions_changed()
    cached = run.progress.cached
    emulator.count_work(len(prompt), cached)
    start = _logprob_start(body, prompt, turn)
    meta = _generate_meta(worker, body, rid, prompt, answer, run, spans, cached, arrival, start)
    text = _text(worker, prompt, answer, sampling, run)
    out: dict[str, Any] = {} if text is None else {"text": text}
    out.update(output_ids=answer.ids, meta_info=meta)
    if body.get("return_prompt_token_ids"):
        out["prompt_token_ids"] = ids  # the request's own ids, as tokenized
    return Reply(200, orjson.dumps(out))


def _generate_meta(
    worker: SglangWorker,
    body: dict[str, Any],
    rid: str,
    prompt: list[int],
    sample: Sample,
    run: Run,
    spans: list[Span],
    cached: int,
    arrival: float,
    start: int | None,
) -> dict[str, Any]:
    """``/generate``'s ``meta_info`` (TM ``_handle_batch_output``; for a
    request aborted in the waiting queue, ``_handle_abort_req``'s).
    ``start``: the scheduler's ``logprob_start_len`` (`_logprob_start`)."""
    n = len(sample.ids)
    reported = reported_spans(spans)
    waiting = run.abort is not None and run.abort.waiting
    meta: dict[str, Any] = {"id": rid, "finish_reason": dict(sample.finish)}
    if waiting:
        meta["weight_version"] = spans[-1].version
        meta["e2e_latency"] = trio.current_time() - arrival
        if reported is not None:
            meta["weight_versions"] = reported
    else:
        meta.update(
            prompt_tokens=len(prompt),
            weight_version=spans[-1].version,
            num_retractions=run.progress.retractions,
        )
    if body.get("return_logprob"):
        # convert_logprob_style: return_text_in_logprobs and not skip_tokenizer_init.
        with_text = body.get("return_text_in_logprobs") is True and worker.has_tokenizer
        template = worker.emulator.speaker.template
        texts: list[str | None] = (
            list(template.decode_pieces(sample.ids)) if with_text else [None] * n
        )
        # The prefill's (its weights are the first token's: spans[0]); a
        # request aborted in the waiting queue was never prefilled.
        meta["input_token_logprobs"] = (
            []
            if waiting or start is None
            else _input_logprobs(worker, prompt, start, spans[0].version, with_text)
        )
        meta["output_token_logprobs"] = [
            [lp, tok, text]
            for lp, tok, text in zip(sample.logprobs, sample.ids, texts, strict=True)
        ]
        meta["output_token_logprobs_length"] = n
    if waiting:
        meta["completion_tokens"] = n
        return meta
    meta.update(
        reasoning_tokens=worker.reasoning_tokens(sample),
        completion_tokens=n,
        cached_tokens=cached,
    )
    if reported is not None:
        meta["weight_versions"] = reported
    routed = worker.routed_experts(body, prompt, sample)
    if routed is not None:
        meta["routed_experts"] = routed
    meta["e2e_latency"] = trio.current_time() - arrival
    return meta


def _input_logprobs(
    worker: SglangWorker, prompt: list[int], start: int, version: str, with_text: bool
) -> list[list[Any]]:
    """SGLang's ``input_token_logprobs`` from ``logprob_start_len`` ``start``:
    ``[logprob, id, text]`` for the prompt tokens ``start..n-1``, the
    first always ``[null, id, text]`` (``_process_input_token_logprobs``:
    ``[None] + input_token_logprobs[:-1]``), the rest the model's
    logprob of each token after the ones before it (`LogprobModel`)."""
    ids = prompt[start:]
    if not ids:
        return []
    emulator = worker.emulator
    values: list[float | None] = [None]
    values.extend(emulator.logprob_model.score(prompt, version, start + 1).logprobs())
    if not with_text:
        return [[lp, tok, None] for lp, tok in zip(values, ids, strict=True)]
    texts = emulator.speaker.template.decode_pieces(ids)
    return [list(entry) for entry in zip(values, ids, texts, strict=True)]


def _text(
    worker: SglangWorker,
    prompt: Sequence[int],
    answer: Sample,
    sampling: Mapping[str, Any],
    run: Run,
) -> str | None:
    """The answer's ``text``: the detokenizer's, the matched stop trimmed
    unless ``no_stop_trim``; with ``--skip-tokenizer-init`` none (the
    scheduler's ``BatchTokenIDOutput`` has no text:
    ``TokenizerManager._handle_batch_output``), except for a request aborted
    in the waiting queue, answered by ``_handle_abort_req`` with its state's
    text, ``""``."""
    if not worker.has_tokenizer:
        return "" if run.abort is not None and run.abort.waiting else None
    ids = answer.ids if sampling.get("no_stop_trim") else text_ids(answer)
    return worker.detokenize(prompt, ids, sampling.get("skip_special_tokens") is not False)


async def _run(
    worker: SglangWorker,
    body: dict[str, Any],
    sampling: dict[str, Any],
    prompt: list[int],
    turn: SessionTurn | None,
    max_new: int | None,
    rid: str,
) -> tuple[Sample, Run]:
    """Sample and wait the GPU time of one /generate request, once past
    the pause gate: (sample, its run)."""
    emulator = worker.emulator
    cfg = emulator.config
    if len(prompt) >= cfg.context_length:
        raise BadRequest(
            f"The input ({len(prompt)} tokens) is longer than the model's context "
            f"length ({cfg.context_length} tokens)."
        )
    if body.get("return_logprob"):
        _check_logprob_start(body.get("logprob_start_len"), len(prompt))
    try:
        if sampling.get("structural_tag"):
            constraint = structural_tag_constraint(sampling.get("structural_tag"))
        else:
            constraint = tool_constraint(sampling.get("json_schema"))
    except ValueError as exc:  # the grammar does not compile: the scheduler aborts
        raise BadRequest(str(exc)) from exc
    room = cfg.context_length - len(prompt)
    if max_new == 0:  # prefill only: nothing sampled (tp_worker skips sampling)
        sample = _prefill_only()
    else:
        budget = max(1, room if max_new is None else min(max_new, room))
        sample = worker.sample(prompt, sampling.get("sampling_seed"), budget, constraint)
        worker.routed_experts(body, prompt, sample)  # a bad start is refused before any work
    start = _logprob_start(body, prompt, turn)
    # Req._compute_max_prefix_len: the cache serves at most logprob_start_len tokens.
    reuse = start if start is not None and start < len(prompt) else None
    await emulator.weights.admit_sglang(rid)
    with emulator.weights.run(rid, "sglang") as run:
        if turn is None or not turn.streaming:
            # A radix-native session (top-level session_id) or a non-streaming
            # session_params session: both reference their KV under the flag.
            hint = body.get("session_id") if turn is None else turn.session_id
            ref = emulator.cache.session_ref(hint if isinstance(hint, str) else None)
            await emulator.gpu.serve(
                cfg, prompt, sample.ids, ref, progress=run.progress, reuse=reuse
            )
        else:
            await emulator.gpu.serve(
                cfg,
                prompt,
                sample.ids,
                None,
                held=turn.held_prefix,
                fill="prompt" if turn.publish else "none",
                progress=run.progress,
            )
    return sample, run


def _check_lengths(context_length: int, prompt_tokens: int, max_new: int | None) -> None:
    """``TokenizerManager._validate_one_request``, on the request's own ids."""
    if prompt_tokens >= context_length:
        raise BadRequest(
            f"The input ({prompt_tokens} tokens) is longer than the model's context "
            f"length ({context_length} tokens)."
        )
    if max_new is not None and max_new + prompt_tokens > context_length:
        raise BadRequest(context_length_message(context_length, prompt_tokens, max_new))


def _check_logprob_start(start: int | None, prompt_tokens: int) -> None:
    """``logprob_start_len`` with ``return_logprob`` (the scheduler's
    ``_handle_generate_request``): -1 (the default) starts at the prompt's end;
    past it, SGLang aborts the request; inside it, the prompt's logprobs from
    there. Below -1 is not modelled."""
    if start is None or start == -1:
        return
    if start > prompt_tokens:
        raise BadRequest(
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_tokens}. Please use a smaller logprob_start_len."
        )
    if start < -1:
        raise BadRequest(f"the emulator does not model logprob_start_len {start} (below -1)")


def _logprob_start(body: dict[str, Any], prompt: list[int], turn: SessionTurn | None) -> int | None:
    """The scheduler's ``logprob_start_len`` of a checked request (None
    without ``return_logprob``): -1 or none is the prompt's end (no input
    logprobs: ``_handle_generate_request``), and so is any start in a
    streaming session (``Req.init_next_round_input`` overrides it to -1)."""
    if not body.get("return_logprob"):
        return None
    start = body.get("logprob_start_len")
    if start is None or start == -1 or (turn is not None and turn.streaming):
        return len(prompt)
    assert isinstance(start, int) and 0 <= start <= len(prompt)
    return start


def _prefill_only() -> Sample:
    """A prefill-only request's answer (``max_new_tokens`` 0): no token
    (``output_ids_through_stop`` is ``output_ids[:finished_len]``, 0), finished
    ``{"type": "length", "length": 0}`` (``Req.update_finish_state``)."""
    return Sample([], [], {"type": "length", "length": 0}, 0, {"role": "assistant", "content": ""})


def _refuse_unmodelled(body: dict[str, Any], sampling: dict[str, Any], tokenizer: bool) -> None:
    """What SGLang would answer and the emulator cannot: refused, never faked.
    Without a tokenizer, a text prompt is SGLang's own refusal (and text
    beside ``input_ids`` is ignored, as ``_tokenize_one_request`` takes the ids)."""
    for key in ("image_data", "video_data", "audio_data", "input_embeds"):
        if body.get(key) is not None:
            raise BadRequest(f"the emulator serves a text model: {key} is not supported")
    if body.get("text") is not None:
        if not tokenizer and body.get("input_ids") is None:
            raise BadRequest(_TEXT_WITHOUT_TOKENIZER)
        if tokenizer:
            raise BadRequest("the emulator never tokenizes text; send input_ids")
    for key in _BATCH_KEYS:
        if isinstance(body.get(key), list):
            raise BadRequest(f"the emulator serves one request per call: {key} must not be a list")
    if lax_true(body.get("return_hidden_states")):
        raise BadRequest("the emulator has no hidden states (return_hidden_states)")
    if body.get("return_logprob") and (
        body.get("top_logprobs_num") or body.get("token_ids_logprob") is not None
    ):
        raise BadRequest("the emulator has no top logprobs (top_logprobs_num, token_ids_logprob)")
    if sampling.get("n") not in (None, 1):
        raise BadRequest("n must be 1")
