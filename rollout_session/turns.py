"""One agent turn, end to end (DESIGN §4.1).

claim → parse → plan the prompt → forward to the worker → validate →
commit → answer, with the slot released on every path. Planning reads the
session, committing mutates it; both are synchronous, and the session's slot
guarantees no other turn runs in between. A rollback decided while planning
is only applied by the commit, so a failed turn never loses history. The
claim and the commit go through the session store, which refuses them when
the journal could not record the turn.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import orjson
import trio

from .context import ServerContext
from .errors import (
    ContextLengthExceeded,
    RolloutSessionError,
    SessionBusy,
    SessionClosing,
    UpstreamMalformed,
)
from .protocol import ChatRequest, StreamMode, parse_chat_request
from .sessions import Session, TurnSlot
from .turn_commit import TurnPlan
from .turn_plan import TurnPolicy, plan_turn
from .upstream import UpstreamReply
from .validation import AnswerCheck, check_answer, decode_cost

__all__ = ["TurnOutcome", "TurnPolicy", "plan_turn", "run_turn", "upstream_body"]

# Fields the server owns in the upstream request (DESIGN §4.1 step 4).
_FORCED = {"logprobs": True, "return_meta_info": True, "no_stop_trim": False, "stream": False}
_DROPPED = (
    "stream_options",
    "input_ids",
    "session_id",
    "session_params",
    "return_routed_experts",
    "routed_experts_start_len",
)


def upstream_body(
    request: ChatRequest,
    plan: TurnPlan,
    model: str | None,
    *,
    session_hint: str | None,
    routed_experts: bool,
) -> bytes:
    body = {k: v for k, v in request.raw.items() if k not in _DROPPED}
    body.update(_FORCED)
    if routed_experts:
        # Only positions not stored yet: O(new tokens) per turn, not O(history).
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = plan.experts_start
    if session_hint is not None:
        # SGLang's stable per-session identity (kept with the session's KV);
        # unlike `session_params` it does not alter the prompt.
        body["session_id"] = session_hint
    if plan.kwargs:
        # The kwargs the prompt was rendered with (server defaults included):
        # SGLang's reasoning parsers read them (`enable_thinking`, `thinking`)
        # to split what the model wrote in the mode its prompt set.
        body["chat_template_kwargs"] = plan.kwargs
    body["input_ids"] = plan.input_ids
    body["rid"] = uuid.uuid4().hex
    if model and not isinstance(body.get("model"), str):
        body["model"] = model
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


@dataclass(slots=True, frozen=True)
class TurnOutcome:
    reply: UpstreamReply  # the worker's answer, passed through
    stream: StreamMode | None  # how the agent wants it: SSE, or None for JSON


async def run_turn(ctx: ServerContext, session_id: str, body: bytes) -> TurnOutcome:
    """Run one turn; the slot is released and the turn committed on return."""
    started = time.perf_counter()
    metrics = ctx.metrics
    try:
        outcome = await _admitted_turn(ctx, session_id, body)
    except RolloutSessionError as exc:
        metrics.turns.labels("error", exc.code).inc()
        if isinstance(exc, SessionBusy):
            metrics.busy.inc()
        elif isinstance(exc, UpstreamMalformed):
            metrics.validation_failures.labels(exc.kind).inc()
        raise
    except trio.Cancelled:
        metrics.turns.labels("cancelled", "cancelled").inc()
        raise
    reply = outcome.reply
    if reply.status != 200:
        metrics.turns.labels("worker_error", str(reply.status)).inc()
        return outcome
    metrics.turns.labels("ok", "ok").inc()
    metrics.upstream_latency.observe(reply.latency_s)
    metrics.overhead.observe(max(time.perf_counter() - started - reply.latency_s, 0.0))
    return outcome


async def _admitted_turn(ctx: ServerContext, session_id: str, body: bytes) -> TurnOutcome:
    store = ctx.store
    session = store.registry.get(session_id)
    async with ctx.pause.turn():
        slot = store.claim(session)
        try:
            with slot.cancel_scope:
                return await _turn(ctx, session, slot, body)
            # Only a close (DELETE, expiry) cancels the slot's scope; it wins.
            raise SessionClosing(f"session {session.id} was closed during the turn")
        finally:
            session.release(slot, store.clock())


async def _turn(ctx: ServerContext, session: Session, slot: TurnSlot, body: bytes) -> TurnOutcome:
    request = await ctx.offload(len(body), parse_chat_request, body)
    plan = await ctx.offload(
        len(body), plan_turn, session, request, ctx.ready_tokenizer, ctx.policy
    )
    wanted = len(plan.input_ids) + (request.max_tokens or 0)
    for limit, what in (
        (ctx.context_length, "the model's context"),
        (ctx.settings.max_session_tokens, "the session token cap (--max-session-tokens)"),
    ):
        if limit is not None and wanted > limit:
            raise ContextLengthExceeded(
                f"prompt of {len(plan.input_ids)} tokens + max_tokens "
                f"{request.max_tokens or 0} exceeds {what} of {limit} tokens",
                param="messages",
            )
    model = ctx.model_info.model if ctx.model_info else None
    session_hint = session.id if ctx.settings.sglang_session_cache else None
    payload = upstream_body(
        request,
        plan,
        model,
        session_hint=session_hint,
        routed_experts=ctx.settings.routed_experts,
    )
    reply = await ctx.pool.chat(session, payload)
    if reply.status != 200:
        # The worker's own error (e.g. SGLang's 400 for a long prompt) is the
        # agent's answer; nothing is committed.
        return TurnOutcome(reply, request.stream_mode)
    try:
        answer, experts = await ctx.offload_process(
            decode_cost(reply.body, experts=ctx.settings.routed_experts),
            check_answer,
            reply.body,
            AnswerCheck(
                sent_prompt_tokens=len(plan.input_ids),
                vocab_size=ctx.ready_tokenizer.vocab_size,
                experts_from=plan.experts_start if ctx.settings.routed_experts else None,
                experts_width=session.trajectory.experts_width if plan.keep_turns else None,
            ),
        )
    except UpstreamMalformed as exc:
        # The worker's circuit breaker counts answers that fail validation.
        ctx.pool.report_failure(reply.worker, f"{exc.kind}: {exc.message}")
        raise
    ctx.pool.report_success(reply.worker)
    # Returns once the turn is durable; the agent hears of it only then.
    await ctx.store.commit(session, slot, plan, answer, reply, experts)
    ctx.metrics.tokens.labels("prompt").inc(len(plan.prompt_ids))
    ctx.metrics.tokens.labels("sampled").inc(len(answer.ids))
    return TurnOutcome(reply, request.stream_mode)
