"""One agent turn, end to end: `TurnRunner`.

claim → parse → plan the prompt → the engine (worker, validation) →
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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

import trio

from ..engines.base import (
    AgentReply,
    CannotContinue,
    Completion,
    Engine,
    EngineRequest,
    Refusal,
)
from ..engines.served_model import ServedModel
from ..errors import (
    InvalidRequest,
    RolloutSessionError,
    ServerPaused,
    SessionBusy,
    SessionClosing,
    SessionTooLarge,
    TurnInterrupted,
    UpstreamMalformed,
)
from ..prompt.messages import assistant_message
from ..prompt.tokenizer import ChatTokenizer
from ..session.commit import Sampled, TurnPlan
from ..session.segments import Branch, Rollback
from ..session.session import Session, TurnSlot
from ..session.store import SessionStore
from ..session.trajectory import Continuation, Turn
from .interrupted import Interruption, OnAbort, relabel
from .limits import PromptRoom, TurnLimits, completion_budget, keep_bytes, prompt_room
from .metrics import TurnMetrics
from .offload import Offload
from .pause import PauseGate
from .plan import TurnPolicy, plan_turn
from .request import ChatRequest, StreamMode, parse_chat_request
from .sampling import pin

__all__ = ["TurnOutcome", "TurnPolicy", "TurnRunner", "plan_turn", "sampled"]

logger = logging.getLogger("rollout_session")

# A protocol's request as the chat request it asks for, decoded once the turn
# holds the session's slot: it may read the session (a Responses request's
# previous response), which no other turn changes meanwhile. Pure and
# synchronous: it runs on a thread when the body is large.
Decode = Callable[[Session], ChatRequest]

# `TurnRunner.limits` of a runner built without them (benches): the defaults.
_DEFAULT_LIMITS: Final = TurnLimits()

# How much more a body's byte costs to plan (tokenise) than to parse.
_TOKENIZE_WEIGHT = 32


def sampled(completion: Completion, requests: Interruption | None = None) -> Sampled:
    """What the session records of an engine's completion (and of the
    requests it took, if its worker interrupted it)."""
    worker, cached, latency = completion.worker, completion.cached_tokens, completion.latency_s
    continuations: tuple[Continuation, ...] = ()
    if requests is not None and requests.continuations:
        worker, cached, latency = requests.worker, requests.cached_tokens, requests.latency_s
        continuations = tuple(requests.continuations)
    return Sampled(
        ids=completion.ids,
        logprobs=completion.logprobs,
        message=assistant_message(
            completion.content, completion.tool_calls, completion.reasoning_content
        ),
        finish_reason=completion.finish_reason,
        model=completion.model,
        weight_version=completion.weight_version,
        cached_tokens=cached,
        worker=worker,
        latency_s=latency,
        experts=completion.experts,
        weight_versions=completion.weight_versions,
        continuations=continuations,
        # The first request's: a continuation's limits are what was left of them.
        sampling=requests.sampling
        if requests is not None and continuations
        else completion.sampling,
    )


@dataclass(slots=True, frozen=True)
class TurnOutcome:
    reply: AgentReply  # the engine's answer in OpenAI chat form, or its own error
    stream: StreamMode | None  # how the agent wants it: SSE, or None for JSON
    # The turn committed, and the index of its segment (None: nothing was).
    turn: Turn | None = None
    segment: int = 0
    latency_s: float = 0.0  # the engine's time (a committed turn's)
    waited_s: float = 0.0  # time an interrupted turn waited for a pause to end


@dataclass(frozen=True, slots=True)
class TurnRunner:
    """Runs turns with exactly what a turn touches; built once the tokenizer
    is loaded (start-up)."""

    store: SessionStore  # claims and commits (the journal's gate)
    pause: PauseGate  # new turns wait while paused
    engine: Engine  # samples the completion: worker, wire format, validation
    offload: Offload  # parse and plan off the loop when large
    metrics: TurnMetrics
    tokenizer: ChatTokenizer
    model: ServedModel  # the context length
    policy: TurnPolicy
    limits: TurnLimits = _DEFAULT_LIMITS  # beyond tokens: what a session keeps

    async def run(self, session_id: str, body: bytes, decode: Decode | None = None) -> TurnOutcome:
        """Run one turn; the slot is released and the turn committed on return.

        `body` is a chat completions request, or, with `decode`, another
        protocol's request that `decode` turns into one (its size still
        decides where parsing and planning run)."""
        started = time.perf_counter()
        metrics = self.metrics
        try:
            outcome = await self._admitted(session_id, body, decode)
        except RolloutSessionError as exc:
            metrics.turns.labels("error", exc.code).inc()
            if isinstance(exc, SessionBusy):
                metrics.busy.inc()
            elif isinstance(exc, SessionTooLarge):
                # Which session hit the budget: the operator's to know.
                logger.info("session %s: turn refused: %s", session_id, exc.message)
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
        metrics.upstream_latency.observe(outcome.latency_s)
        spent = time.perf_counter() - started - outcome.latency_s - outcome.waited_s
        metrics.overhead.observe(max(spent, 0.0))
        return outcome

    def count_tokens(self, session_id: str, decode: Decode) -> int:
        """The prompt tokens the request `decode` makes would send, nothing
        committed (Anthropic's count_tokens). Synchronous, on the loop: the
        session does not change while it is read (commits run on the loop)."""
        session = self.store.registry.get(session_id)
        request = decode(session)
        plan = plan_turn(session, request, self.tokenizer, self.policy, self._room(request))
        return len(plan.input_ids)

    def _plan(self, session: Session, request: ChatRequest) -> TurnPlan:
        """The turn's plan, within its token room and the session's byte
        budget (its new messages encoded for the commit, measured)."""
        plan = plan_turn(session, request, self.tokenizer, self.policy, self._room(request))
        keep_bytes(session, plan, self.limits.max_session_bytes)
        return plan

    def _room(self, request: ChatRequest) -> PromptRoom | None:
        return prompt_room(
            request.max_tokens,
            context_length=self.model.context_length,
            session_cap=self.policy.max_session_tokens,
        )

    async def _admitted(self, session_id: str, body: bytes, decode: Decode | None) -> TurnOutcome:
        store = self.store
        session = store.registry.get(session_id)
        while True:
            # What ends a wait at the gate early (made only when there is one).
            stop = session.stopped() if self.pause.paused else None
            async with self.pause.turn(stop) as admitted:
                if admitted:
                    slot = store.claim(session)
                    try:
                        with slot.cancel_scope:
                            return await self._turn(session, slot, body, decode)
                        # Only a close (DELETE, expiry) cancels the slot's scope; it wins.
                        raise SessionClosing(f"session {session.id} was closed during the turn")
                    finally:
                        session.release(slot, store.clock())
            # The session stopped taking turns while this one waited for a
            # pause to end: refused at once, as the session refuses turns.
            refusal = session.refusal()
            if refusal is not None:
                raise refusal
            # Open again (its collection could not be journaled): wait again.

    async def _turn(
        self, session: Session, slot: TurnSlot, body: bytes, decode: Decode | None
    ) -> TurnOutcome:
        offload, policy, model = self.offload, self.policy, self.model
        if decode is None:
            request = await offload.run(len(body), parse_chat_request, body)
        else:
            request = await offload.run(len(body), decode, session)
        most = self.limits.max_messages
        if len(request.messages) > most:  # as converted: a protocol's items may expand
            raise InvalidRequest(
                f"the request holds {len(request.messages)} messages; a turn may carry at "
                f"most {most} (--max-messages)",
                param="messages",
            )
        request = self._pinned(session, request)
        # Tokenising costs far more per byte than parsing: weighed so that a
        # body carrying long new text is planned on a thread, where the
        # tokenizer releases the GIL.
        plan = await offload.run(len(body) * _TOKENIZE_WEIGHT, self._plan, session, request)
        budget = completion_budget(
            len(plan.input_ids),
            request.max_tokens,
            context_length=model.context_length,
            session_cap=policy.max_session_tokens,
        )
        priority = session.priority if session.priority is not None else policy.default_priority
        first = EngineRequest(
            params=request.raw,
            input_ids=plan.input_ids,
            template_kwargs=plan.kwargs,
            vocab_size=self.tokenizer.vocab_size,
            max_tokens=budget,
            priority=priority,
            experts_from=plan.experts_start if policy.routed_experts else None,
            experts_width=session.trajectory.experts_width if plan.keep_turns else None,
            aborts_continue=policy.on_abort is OnAbort.CONTINUE,
        )
        result, interruption, waited = await self._sample(session, first)
        if isinstance(result, Refusal):
            return TurnOutcome(result.reply, request.stream_mode, waited_s=waited)
        # Returns once the turn is durable; the agent hears of it only then.
        turn = await self.store.commit(session, slot, plan, sampled(result, interruption))
        if plan.branch is not None:
            self._report_segment(session, plan.branch)
        elif plan.rollback is not None:
            self._report_rollback(session, plan.rollback)
        self.metrics.tokens.labels("prompt").inc(len(plan.prompt_ids))
        self.metrics.tokens.labels("sampled").inc(len(result.ids))
        return TurnOutcome(
            result.reply,
            request.stream_mode,
            turn,
            len(session.earlier),
            interruption.latency_s,
            waited,
        )

    async def _sample(
        self, session: Session, first: EngineRequest
    ) -> tuple[Completion | Refusal, Interruption, float]:
        """The engine's completion of `first`: when its worker aborts it (a
        weight update, a pause), continued until it finishes (--on-abort
        continue), each further request counted; also the seconds the turn
        waited for a pause to end."""
        policy, metrics, pause = self.policy, self.metrics, self.pause
        interruption = Interruption(first)
        request, waited = first, 0.0
        declared = pause.declared_version
        while True:
            try:
                result = await self.engine.complete(session, request)
            except ServerPaused:
                if request.partial is not None:  # its worker stayed paused (by its trainer)
                    logger.warning(
                        "session %s: the turn's worker stayed paused past --pause-wait-s; "
                        "its %d sampled token(s) are dropped and nothing is committed",
                        session.id,
                        len(request.partial.ids),
                    )
                raise
            except CannotContinue as exc:
                metrics.interrupted.labels("resampled").inc()
                logger.info(
                    "session %s: the turn cannot be continued exactly (%s); sampling it "
                    "afresh, %d sampled token(s) dropped",
                    session.id,
                    exc,
                    request.sampled_before,
                )
                request = interruption.resample(request)
                continue
            if isinstance(result, Refusal):
                if request.partial is not None:
                    logger.warning(
                        "session %s: the worker refused the turn's continuation (%d); "
                        "its %d sampled token(s) are dropped and the agent gets the refusal",
                        session.id,
                        result.reply.status,
                        len(request.partial.ids),
                    )
                return result, interruption, waited
            if request.partial is not None:
                metrics.interrupted.labels("continued").inc()
            result = replace(
                result,
                weight_versions=relabel(result.weight_versions, request.sampled_before, declared),
            )
            interruption.answered(result)
            if result.finish_reason != "abort" or policy.on_abort is OnAbort.RETURN:
                if result.finish_reason == "abort":
                    metrics.interrupted.labels("returned").inc()
                metrics.reprefilled.inc(interruption.reprefilled)
                return result, interruption, waited
            if len(interruption.continuations) >= policy.max_continuations:
                metrics.interrupted.labels("failed").inc()
                raise TurnInterrupted(
                    f"the worker interrupted the turn {len(interruption.continuations) + 1} "
                    f"time(s) (--max-continuations {policy.max_continuations}); nothing "
                    "was committed"
                )
            pause_s = await pause.wait_to_continue()
            if pause_s:
                metrics.pause_wait.observe(pause_s)
                waited += pause_s
            declared = pause.declared_version
            if self._ends_turn(result, first):
                # SGLang's abort still runs one decode step: it may have been
                # the end of the answer. What follows an end-of-turn token
                # would not be the model's answer: sampled afresh.
                metrics.interrupted.labels("resampled").inc()
                logger.info(
                    "session %s: the aborted answer ends with a stop token; sampling the "
                    "turn afresh, %d sampled token(s) dropped",
                    session.id,
                    len(result.ids),
                )
                request = interruption.restart(len(result.ids))
            else:
                request = interruption.next_request(result)

    def _ends_turn(self, aborted: Completion, first: EngineRequest) -> bool:
        """Whether the aborted answer's last token is one it stops on."""
        if not len(aborted.ids):
            return False
        params = first.params
        stops = set(params.get("stop_token_ids") or ())
        if not params.get("ignore_eos"):
            stops |= self.tokenizer.stop_ids
        return int(aborted.ids[-1]) in stops

    def _pinned(self, session: Session, request: ChatRequest) -> ChatRequest:
        """`request` with the session's pinned sampling; each agent value it
        replaced (or refused) counted."""
        mode = self.policy.on_sampling_conflict
        try:
            pinned, conflicts = pin(request, session.sampling, mode)
        except InvalidRequest as refused:
            self.metrics.sampling_conflicts.labels(refused.param or "", mode.value).inc()
            raise
        for conflict in conflicts:
            self.metrics.sampling_conflicts.labels(conflict.param, mode.value).inc()
        return pinned

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
