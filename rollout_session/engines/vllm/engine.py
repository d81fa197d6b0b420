"""The ``vllm`` engine: one turn through vLLM's ``/inference/v1/generate``.

The worker is sent the prompt ids and the sampling parameters vLLM's chat
route would have built (`request`), with ``output_mode: "derender"`` and the
request's ``parse_context``, so vLLM samples, then parses the answer with
its own ``--tool-call-parser`` / ``--reasoning-parser`` in the same call.
A tool-call constraint only vLLM can build (a structural tag) is first asked
of the worker's ``/v1/chat/completions/render``.
The answer is checked strictly (`answer`) and the agent is answered with
the chat completion the SGLang engines write (`reply`). Continuing a partial
completion is not offered yet. docs/engines.md#vllm has the choice of route
and its evidence.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from ...errors import UpstreamMalformed
from ..base import (
    AgentReply,
    CannotContinue,
    Completion,
    EngineRequest,
    EngineSession,
    Refusal,
    Validation,
)
from ..pool import WorkerPool
from ..served_model import ServedModel
from ..sglang_chat.answer import AnswerCheck
from .answer import check_vllm_answer
from .reply import chat_completion, error_reply
from .request import (
    Untranslatable,
    VllmOptions,
    generate_body,
    parser_constrains,
    render_body,
    sampling_params,
)
from .worker import GENERATE_PATH

RENDER_PATH = "/v1/chat/completions/render"


class _RenderedSampling(msgspec.Struct):
    structured_outputs: dict[str, Any] | None = None


class _Rendered(msgspec.Struct):
    """What is read of /render's GenerateRequest (the prompt ids are skipped)."""

    sampling_params: _RenderedSampling


_RENDERED = msgspec.json.Decoder(_Rendered)

__all__ = ["VllmEngine"]


@dataclass(slots=True)
class VllmEngine:
    pool: WorkerPool
    validation: Validation
    model: ServedModel
    options: VllmOptions = field(default_factory=VllmOptions)

    can_continue: ClassVar[bool] = False

    async def complete(
        self, session: EngineSession, request: EngineRequest
    ) -> Completion | Refusal:
        if request.partial is not None:
            raise CannotContinue("the vllm engine does not continue partial completions yet")
        request_id = uuid.uuid4().hex
        upstream = self.model.upstream_name(request.params.get("model"))
        try:
            sampling = sampling_params(request, self.options, self.model.context_length)
        except Untranslatable as exc:
            return Refusal(error_reply(400, str(exc), exc.param), session.worker or "")
        if parser_constrains(request.params, self.options.parsers):
            rendered = await self._constraint(session, request, upstream)
            if isinstance(rendered, Refusal):
                return rendered
            sampling["structured_outputs"] = rendered
        payload = generate_body(
            request,
            self.options,
            request_id=request_id,
            model=upstream,
            context=self.model.context_length,
            sampling=sampling,
        )
        reply = await self.pool.chat(session, payload, GENERATE_PATH)
        if reply.status != 200:
            # vLLM's own error, already in the OpenAI shape; nothing is committed.
            return Refusal(AgentReply(reply.status, reply.headers, reply.body), reply.worker)
        check = AnswerCheck.of(request)
        try:
            answer = await self.validation.validate(
                check_vllm_answer, reply.body, check, len(reply.body)
            )
        except UpstreamMalformed as exc:
            self.pool.report_failure(reply.worker, f"{exc.kind}: {exc.message}")
            raise
        self.pool.report_success(reply.worker)
        model = answer.model or upstream or "default"
        include_reasoning = request.params.get("include_reasoning") is not False
        body = chat_completion(
            f"chatcmpl-{request_id}", model, answer, include_reasoning=include_reasoning
        )
        return Completion(
            ids=answer.ids,
            logprobs=answer.logprobs,
            content=answer.content or "",  # as the reply has it (never null)
            tool_calls=answer.tool_calls,
            reasoning_content=answer.reasoning,
            finish_reason=answer.finish_reason,
            model=model,
            weight_version=answer.weight_version,
            cached_tokens=answer.cached_tokens,
            experts=answer.experts,
            worker=reply.served_by,
            latency_s=reply.latency_s,
            reply=AgentReply(200, [(b"content-type", b"application/json")], body),
        )

    async def _constraint(
        self, session: EngineSession, request: EngineRequest, model: str | None
    ) -> dict[str, Any] | Refusal | None:
        """The tool-call constraint vLLM's chat route builds for this request
        (its parsers' adjust_request, xgrammar's structural tag), from the
        session's worker's ``/v1/chat/completions/render``; its refusal as
        the agent's answer."""
        reply = await self.pool.chat(session, render_body(request, model), RENDER_PATH)
        if reply.status != 200:
            return Refusal(AgentReply(reply.status, reply.headers, reply.body), reply.worker)
        try:
            rendered = _RENDERED.decode(reply.body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.pool.report_failure(reply.worker, f"render: {exc}")
            raise UpstreamMalformed(
                f"the worker's {RENDER_PATH} answer is not a GenerateRequest: {exc}",
                kind="render",
            ) from None
        return rendered.sampling_params.structured_outputs

    def adopt(self, session: EngineSession) -> None:
        self.pool.adopt(session)

    def release(self, session: EngineSession) -> None:
        self.pool.release_session(session)

    async def close_worker_sessions(self, sessions: Iterable[EngineSession]) -> None:
        """vLLM keeps no per-session state a server could free."""
