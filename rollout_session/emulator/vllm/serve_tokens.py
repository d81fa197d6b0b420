"""vLLM 0.33.0's ``POST /inference/v1/generate``: a checked request to its answer.

Models ``entrypoints/scale_out/token_in_token_out/serving.py``
``ServingTokens.serve_tokens`` past the request checks (`generate`): the
engine id (``BaseServing._base_request_id``: ``X-Request-Id`` wins over
the body's), the pause gate (``v1/engine/core.py``
``EngineCoreProc._reject_add_while_paused``), the GPU time (abortable),
where vLLM stops (`answer.finish`), prompt logprobs
(``v1/engine/logprobs.py`` ``LogprobsProcessor``) and the answer
(`answer.generate_answer`). Injected faults (``faults``) pick its fate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

import orjson
import trio

from rollout_session.emulator.faults import (
    FAULT_HEADER,
    BadRequest,
    Reply,
    vllm_early_fault_reply,
    vllm_fault_reply,
)
from rollout_session.emulator.records import ChatRecord
from rollout_session.emulator.vllm.answer import (
    Outcome,
    aborted,
    derender_message,
    finish,
    generate_answer,
    json_tool_constraint,
    mark_whole,
    routed_experts_npy,
)
from rollout_session.emulator.vllm.errors import VllmError, not_modelled
from rollout_session.emulator.vllm.generate import GenerateRequest, check_request
from rollout_session.emulator.weights import Span
from rollout_session.emulator.worker import UNBOUNDED

if TYPE_CHECKING:
    from rollout_session.emulator.vllm.worker import VllmWorker

__all__ = ["serve"]

# EngineCoreProc._reject_add_while_paused's RequestError, raised as
# RetryableRequestError: 503 ServiceUnavailableError (error_response.py).
_PAUSED: Final = "Generation is paused. Please retry after it resumes."


async def serve(worker: VllmWorker, raw: bytes, headers: Mapping[str, str]) -> Reply:
    """One ``/inference/v1/generate`` call: recorded, checked, served."""
    emulator = worker.emulator
    arrival = trio.current_time()
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    try:
        fault = emulator.faults.pick(headers.get(FAULT_HEADER.lower()), body)
    except ValueError as exc:
        fault = None
        early: Reply | None = VllmError(str(exc)).reply()
    else:
        early = None
    session = headers.get("x-session-id")
    emulator.record(ChatRecord(body, arrival, fault, session, "vllm-generate", len(raw), headers))
    if early is not None:
        return early
    if fault is not None:
        emulator.faults_injected[fault] += 1
    if fault in ("http_500", "http_400"):
        return vllm_early_fault_reply(fault)
    try:
        request = check_request(raw, headers.get("content-type", ""), worker.server)
        return await _serve(worker, request, headers, fault)
    except VllmError as exc:
        return exc.reply()


async def _serve(
    worker: VllmWorker, request: GenerateRequest, headers: Mapping[str, str], fault: str | None
) -> Reply:
    """Sample, cut where vLLM stops, wait the GPU time (abortable), answer."""
    emulator = worker.emulator
    cfg = emulator.config
    decode = emulator.decode
    s = request.sampling
    engine_id = f"generate-tokens-{headers.get('x-request-id') or request.request_id}"
    prompt = request.token_ids
    constraint = json_tool_constraint(s.constraint, request.parse_context)
    try:
        sample = emulator.sample(prompt, s.seed, UNBOUNDED, constraint)
    except BadRequest as exc:
        raise VllmError(str(exc)) from None
    worker.answers.note(sample.whole or sample)
    ended = sample.finish.get("type") == "stop" and isinstance(sample.finish.get("matched"), int)
    whole_text = decode(sample.ids[:-1] if ended else sample.ids, s.skip_special_tokens)
    outcome = mark_whole(
        finish(
            sample.ids,
            sample.logprobs,
            ended,
            s,
            request.max_tokens,
            decode,
            emulator.model.tokenizer.eos_token_id,
            worker.extra_eos,
        ),
        whole_text if s.detokenize else "",
    )
    if fault == "abort":  # aborted mid-decode: one token short
        outcome = aborted(outcome, len(outcome.ids) - 1, decode, s, whole_text)
    scored = s.prompt_logprobs is not None
    decoded = _decoded_prompt(worker, prompt) if scored and s.detokenize else None
    if emulator.weights.refuses_vllm():  # /pause in abort or wait mode
        return VllmError(_PAUSED, type_="ServiceUnavailableError", code=503).reply()
    with emulator.weights.run(engine_id, "vllm") as run:
        if fault == "stall":
            await trio.sleep_forever()
        # Prompt logprobs skip reading the prefix cache (SamplingParams
        # __post_init__: skip_reading_prefix_cache).
        await emulator.gpu.serve(
            cfg, prompt, outcome.ids, None, progress=run.progress, reuse=0 if scored else None
        )
    cached = run.progress.cached
    if run.abort is not None:  # /inference/v1/abort_requests, /pause, /abort_requests
        outcome = aborted(outcome, run.abort.tokens, decode, s, whole_text)
        if run.progress.phase == "decode":
            emulator.cache.insert([*prompt, *outcome.ids])  # its computed blocks stay cached
    spans = emulator.weights.spans(run, len(outcome.ids))
    outcome = replace(outcome, logprobs=emulator.policy(prompt, outcome.ids, spans))
    prompt_logprobs = None
    if scored and (run.abort is None or run.progress.phase in ("decode", "done")):
        # Computed by the prefill, whose weights sampled the first token;
        # an abort before the prefill ended leaves none.
        version = spans[0].version if spans else None
        if version is None and run.abort is not None:
            version = run.abort.version  # vLLM closes an aborted request's label
        prompt_logprobs = _prompt_logprobs(
            worker, prompt, version or emulator.weights.version, decoded
        )
    emulator.count_work(len(prompt), cached)
    return _reply(
        worker, request, engine_id, sample.message, outcome, cached, fault, spans, prompt_logprobs
    )


def _decoded_prompt(worker: VllmWorker, prompt: list[int]) -> list[str]:
    """``decoded_token`` of each prompt token (``convert_ids_list_to_tokens``:
    ``tokenizer.decode([id])``, no leading-space marker in the emulator's
    byte-level tokenizers); a piece ending in U+FFFD, which vLLM corrects
    from the tokens before it (``LogprobsProcessor._verify_tokens``), is
    refused as not modelled."""
    pieces = worker.decoded_pieces(prompt[1:])
    if any(piece.endswith("\ufffd") for piece in pieces):
        raise not_modelled(
            "prompt logprobs of a prompt with byte-fallback tokens with detokenize: true "
            "(send detokenize: false)",
            "prompt_logprobs",
        )
    return pieces


def _prompt_logprobs(
    worker: VllmWorker, prompt: list[int], version: str, decoded: list[str] | None
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` for ``prompt_logprobs: 0``: ``None``
    for the first token (``create_prompt_logprobs``), then per position
    ``{"<id>": {"logprob", "rank", "decoded_token"}}``, the prompt token
    alone (``append_logprobs_for_next_position``), its logprob the
    model's (`LogprobModel`; never -inf, so ``clamp_prompt_logprobs``
    changes nothing)."""
    scores = worker.emulator.logprob_model.score(prompt, version, 1)
    pieces: Sequence[str | None] = decoded if decoded is not None else [None] * len(scores)
    out: list[dict[str, dict[str, Any]] | None] = [None]
    out.extend(
        {str(tok): {"logprob": lp, "rank": rank, "decoded_token": piece}}
        for tok, lp, rank, piece in zip(
            prompt[1:], scores.logprobs(), scores.ranks(), pieces, strict=True
        )
    )
    return out


def _reply(
    worker: VllmWorker,
    request: GenerateRequest,
    engine_id: str,
    sampled_message: Mapping[str, Any],
    outcome: Outcome,
    cached: int,
    fault: str | None,
    spans: Sequence[Span],
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None,
) -> Reply:
    cfg = worker.emulator.config
    prompt = request.token_ids
    context = request.derender_context
    message = (
        derender_message(outcome, sampled_message, worker.server, context)
        if request.output_mode == "derender"
        else None
    )
    routed = None
    n = len(outcome.ids)
    if cfg.return_routed_experts and n:
        # Rows: positions from routed_experts_prompt_start to the last
        # forwarded one (the last sampled token is never forwarded).
        forwarded = (prompt + outcome.ids)[: len(prompt) + n - 1]
        start = min(request.sampling.routed_experts_prompt_start, len(forwarded))
        routed = routed_experts_npy(
            forwarded,
            start,
            layers=cfg.routed_experts_layers,
            top_k=cfg.routed_experts_top_k,
            num_experts=cfg.routed_experts_num_experts,
        )
    answer = generate_answer(
        request=request,
        request_id=engine_id,
        model=cfg.model_name,
        outcome=outcome,
        prompt_tokens=len(prompt),
        cached_tokens=cached if cfg.enable_prompt_tokens_details else None,
        routed=routed,
        weight_versions=[span.json() for span in spans],
        message=message,
        hide_metadata=context is not None and not context.include_reasoning,
        token=worker.token_text,
        prompt_logprobs=prompt_logprobs,
    )
    if fault is None or fault in ("abort", "stall"):
        return Reply(200, orjson.dumps(answer))
    return vllm_fault_reply(fault, answer, worker.emulator.model.vocab_size)
