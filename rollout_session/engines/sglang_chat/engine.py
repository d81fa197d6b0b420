"""The `sglang-chat` engine: one turn through SGLang's chat route.

The agent's own body goes to the worker with the server's fields forced
(the prompt as ``input_ids``, logprobs and meta info on, no streaming):
SGLang applies its chat route's sampling defaults, stop handling, tool-call
and reasoning parsers as it would for the agent, and the answer comes back
in OpenAI form, so the agent is answered with the worker's own body. What
the route hides (``session_params``, continuing a partial completion) this
engine cannot do: it refuses a continuation (`CannotContinue`: the route
would parse the continuation's text without the partial's), so an
interrupted turn is sampled afresh.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from ...prompt.tokenizer import ChatTokenizer
from ..answer import AnswerCheck
from ..base import (
    AgentReply,
    CannotContinue,
    Completion,
    EngineCounter,
    EngineRequest,
    EngineSession,
    Refusal,
)
from ..pool import Check, WorkerPool, WorkerRequest
from ..sampling import applied
from ..served_model import ServedModel
from ..stitch import version_spans
from .answer import check_answer, decode_cost
from .workers import CHAT_PATH

__all__ = ["SGLangChatEngine", "chat_body"]

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


def chat_body(
    request: EngineRequest, model: str | None, *, session_hint: str | None, rid: str
) -> bytes:
    """The worker's request: the agent's body with the server's fields."""
    body: dict[str, Any] = {k: v for k, v in request.params.items() if k not in _DROPPED}
    body.update(_FORCED)
    if request.max_tokens is not None:
        # The session cap's remainder, for a request that set no limit.
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = request.max_tokens
    if request.experts_from is not None:
        # Only positions not stored yet: O(new tokens) per turn, not O(history).
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = request.experts_from
    if session_hint is not None:
        # SGLang's stable per-session identity (kept with the session's KV);
        # unlike `session_params` it does not alter the prompt.
        body["session_id"] = session_hint
    if request.priority is not None:
        # The session's, over whatever the agent sent (SGLang ignores it
        # unless the worker runs --enable-priority-scheduling).
        body["priority"] = request.priority
    if request.template_kwargs:
        # The kwargs the prompt was rendered with (server defaults included):
        # SGLang's reasoning parsers read them (`enable_thinking`, `thinking`)
        # to split what the model wrote in the mode its prompt set.
        body["chat_template_kwargs"] = request.template_kwargs
    body["input_ids"] = request.input_ids
    body["rid"] = rid  # what a pause in abort mode aborts it by
    if model:
        # Replaces the agent's: ServedModel.upstream_name decided it (--upstream-model).
        body["model"] = model
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _sent_sampling(request: EngineRequest) -> dict[str, Any]:
    """The sampling keys `chat_body` sends (the rest: the chat route's own
    defaults, the model's generation_config)."""
    params = request.params
    limit = params.get("max_completion_tokens", params.get("max_tokens"))
    if request.max_tokens is not None:
        limit = request.max_tokens
    return applied({**params, "max_tokens": limit})


@dataclass(frozen=True, slots=True)
class SGLangChatEngine:
    pool: WorkerPool  # the session's sticky worker, failover, checks, circuit breaker
    model: ServedModel  # the name turns are sent with
    session_hints: bool = False  # --kv-sessions hint: the session id on every turn

    can_continue: ClassVar[bool] = False

    async def complete(
        self, session: EngineSession, request: EngineRequest
    ) -> Completion | Refusal:
        if request.partial is not None:
            raise CannotContinue(
                "SGLang's /v1/chat/completions parses only what it samples: a "
                "continuation's answer would be parsed without the partial's text"
            )
        rid = uuid.uuid4().hex
        payload = chat_body(
            request,
            self.model.upstream_name(request.params.get("model")),
            session_hint=session.id if self.session_hints else None,
            rid=rid,
        )
        experts = request.experts_from is not None
        sent = await self.pool.send(
            session,
            WorkerRequest(
                path=CHAT_PATH,
                body=payload,
                request_id=rid,
                check=Check(
                    check_answer,
                    AnswerCheck.of(request),
                    cost=lambda body: decode_cost(body, experts=experts),
                ),
            ),
        )
        reply = sent.reply
        agent_reply = AgentReply(reply.status, reply.headers, reply.body)
        if reply.status != 200:
            # The worker's own error (e.g. SGLang's 400 for a long prompt) is
            # the agent's answer; nothing is committed.
            return Refusal(agent_reply, reply.worker)
        answer, routed = sent.checked
        return Completion(
            ids=answer.ids,
            logprobs=answer.logprobs,
            content=answer.content,
            tool_calls=answer.tool_calls,
            reasoning_content=answer.reasoning_content,
            finish_reason=answer.finish_reason,
            model=answer.model,
            weight_versions=version_spans(
                answer.weight_versions, answer.weight_version, len(answer.ids)
            ),
            cached_tokens=answer.cached_tokens,
            experts=routed,
            worker=reply.served_by,  # behind a gateway, the worker it routed to
            latency_s=reply.latency_s,
            reply=agent_reply,
            sampling=_sent_sampling(request),
        )

    async def prepare(self, tokenizer: ChatTokenizer) -> None:
        """Nothing to read: the worker's chat route applies the model's defaults."""

    def counters(self) -> Iterable[EngineCounter]:
        return ()

    def adopt(self, session: EngineSession) -> None:
        self.pool.adopt(session)

    def release(self, session: EngineSession) -> None:
        self.pool.release_session(session)

    async def close_worker_sessions(self, sessions: Iterable[EngineSession]) -> None:
        await self.pool.close_remote_sessions(sessions)
