"""One agent turn, end to end: `TurnRunner`.

claim → parse → plan the prompt → forward to the worker → validate →
commit → answer, with the slot released on every path. Planning reads the
session, committing mutates it; both are synchronous, and the session's slot
guarantees no other turn runs in between. A rollback or new segment decided
while planning is only applied by the commit, so a failed turn never loses history. The
claim and the commit go through the session store, which refuses them when
the journal could not record the turn.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import orjson
import trio

from ..engines.answer import AnswerCheck
from ..engines.pool import WorkerPool
from ..engines.served_model import ServedModel
from ..engines.upstream import UpstreamReply
from ..errors import RolloutSessionError, SessionBusy, SessionClosing, UpstreamMalformed
from ..http.metrics import Metrics
from ..prompt.tokenizer import ChatTokenizer
from ..session.commit import TurnPlan
from ..session.lifecycle import PauseGate
from ..session.segments import Branch, Rollback
from ..session.session import Session, TurnSlot
from ..session.store import SessionStore
from ..session.trajectory import Turn
from .limits import check_prompt_floor, completion_budget
from .offload import Offload
from .plan import TurnPolicy, plan_turn
from .request import ChatRequest, StreamMode, parse_chat_request
from .validator import AnswerValidator

__all__ = ["TurnOutcome", "TurnPolicy", "TurnRunner", "plan_turn", "upstream_body"]

logger = logging.getLogger("rollout_session")

# Fields the server owns in the upstream request: what it needs back to keep
# the trajectory exact (docs/api.md#what-the-worker-is-sent).
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
    max_tokens: int | None = None,
    priority: int | None = None,
) -> bytes:
    """The worker's request: the agent's body with the server's fields."""
    body = {k: v for k, v in request.raw.items() if k not in _DROPPED}
    body.update(_FORCED)
    if max_tokens is not None:
        # The session cap's remainder, for a request that set no limit.
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = max_tokens
    if routed_experts:
        # Only positions not stored yet: O(new tokens) per turn, not O(history).
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = plan.experts_start
    if session_hint is not None:
        # SGLang's stable per-session identity (kept with the session's KV);
        # unlike `session_params` it does not alter the prompt.
        body["session_id"] = session_hint
    if priority is not None:
        # The session's, over whatever the agent sent (SGLang ignores it
        # unless the worker runs --enable-priority-scheduling).
        body["priority"] = priority
    if plan.kwargs:
        # The kwargs the prompt was rendered with (server defaults included):
        # SGLang's reasoning parsers read them (`enable_thinking`, `thinking`)
        # to split what the model wrote in the mode its prompt set.
        body["chat_template_kwargs"] = plan.kwargs
    body["input_ids"] = plan.input_ids
    body["rid"] = uuid.uuid4().hex
    if model:
        # Replaces the agent's: ServedModel.upstream_name decided it (--upstream-model).
        body["model"] = model
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


# How much more a body's byte costs to plan (tokenise) than to parse.
_TOKENIZE_WEIGHT = 32


@dataclass(slots=True, frozen=True)
class TurnOutcome:
    reply: UpstreamReply  # the worker's answer, passed through
    stream: StreamMode | None  # how the agent wants it: SSE, or None for JSON
    # The turn committed, and the index of its segment (None: nothing was).
    turn: Turn | None = None
    segment: int = 0


@dataclass(frozen=True, slots=True)
class TurnRunner:
    """Runs turns with exactly what a turn touches; built once the tokenizer
    is loaded (start-up)."""

    store: SessionStore  # claims and commits (the journal's gate)
    pause: PauseGate  # new turns wait while paused
    pool: WorkerPool  # the session's sticky worker
    validator: AnswerValidator  # checks every worker answer
    offload: Offload  # parse and plan off the loop when large
    metrics: Metrics
    tokenizer: ChatTokenizer
    model: ServedModel  # name sent upstream, context length
    policy: TurnPolicy

    async def run(self, session_id: str, body: bytes) -> TurnOutcome:
        """Run one turn; the slot is released and the turn committed on return."""
        started = time.perf_counter()
        metrics = self.metrics
        try:
            outcome = await self._admitted(session_id, body)
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

    async def _admitted(self, session_id: str, body: bytes) -> TurnOutcome:
        store = self.store
        session = store.registry.get(session_id)
        async with self.pause.turn():
            slot = store.claim(session)
            try:
                with slot.cancel_scope:
                    return await self._turn(session, slot, body)
                # Only a close (DELETE, expiry) cancels the slot's scope; it wins.
                raise SessionClosing(f"session {session.id} was closed during the turn")
            finally:
                session.release(slot, store.clock())

    async def _turn(self, session: Session, slot: TurnSlot, body: bytes) -> TurnOutcome:
        offload, policy, model = self.offload, self.policy, self.model
        request = await offload.run(len(body), parse_chat_request, body)
        check_prompt_floor(
            request.messages,
            request.max_tokens,
            max_token_bytes=self.tokenizer.max_token_bytes,
            context_length=model.context_length,
            session_cap=policy.max_session_tokens,
            body_bytes=len(body),
        )
        # Tokenising costs far more per byte than parsing: weighed so that a
        # body carrying long new text is planned on a thread, where the
        # tokenizer releases the GIL.
        plan = await offload.run(
            len(body) * _TOKENIZE_WEIGHT, plan_turn, session, request, self.tokenizer, policy
        )
        budget = completion_budget(
            len(plan.input_ids),
            request.max_tokens,
            context_length=model.context_length,
            session_cap=policy.max_session_tokens,
        )
        payload = upstream_body(
            request,
            plan,
            model.upstream_name(request.raw.get("model")),
            session_hint=session.id if policy.session_hint else None,
            routed_experts=policy.routed_experts,
            max_tokens=budget,
            priority=session.priority if session.priority is not None else policy.default_priority,
        )
        reply = await self.pool.chat(session, payload)
        if reply.status != 200:
            # The worker's own error (e.g. SGLang's 400 for a long prompt) is
            # the agent's answer; nothing is committed.
            return TurnOutcome(reply, request.stream_mode)
        try:
            answer, experts = await self.validator.validate(
                reply.body,
                AnswerCheck(
                    sent_prompt_tokens=len(plan.input_ids),
                    vocab_size=self.tokenizer.vocab_size,
                    experts_from=plan.experts_start if policy.routed_experts else None,
                    experts_width=session.trajectory.experts_width if plan.keep_turns else None,
                ),
            )
        except UpstreamMalformed as exc:
            # The worker's circuit breaker counts answers that fail validation.
            self.pool.report_failure(reply.worker, f"{exc.kind}: {exc.message}")
            raise
        self.pool.report_success(reply.worker)
        # Returns once the turn is durable; the agent hears of it only then.
        turn = await self.store.commit(session, slot, plan, answer, reply, experts)
        if plan.branch is not None:
            self._report_segment(session, plan.branch)
        elif plan.rollback is not None:
            self._report_rollback(session, plan.rollback)
        self.metrics.tokens.labels("prompt").inc(len(plan.prompt_ids))
        self.metrics.tokens.labels("sampled").inc(len(answer.ids))
        return TurnOutcome(reply, request.stream_mode, turn, len(session.earlier))

    def _report_rollback(self, session: Session, rollback: Rollback) -> None:
        # Never silent: the dropped turns' sampled tokens left the trajectory.
        self.metrics.rollbacks.labels(rollback.reason.value).inc()
        logger.info(
            "session %s: rollback (%s): %d turn(s) of segment %d dropped; the request "
            "differs from the stored history at message %d",
            session.id,
            rollback.reason.value,
            rollback.dropped_turns,
            rollback.segment,
            rollback.message,
        )

    def _report_segment(self, session: Session, branch: Branch) -> None:
        self.metrics.segments.labels(branch.reason.value).inc()
        logger.info(
            "session %s: new segment %d (%s): the request differs from segment %d's "
            "history at message %d",
            session.id,
            len(session.earlier),
            branch.reason.value,
            branch.segment,
            branch.message,
        )
