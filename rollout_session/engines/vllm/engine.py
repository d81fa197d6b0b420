"""The ``vllm`` engine: one turn through vLLM's ``/inference/v1/generate``.

The worker is sent the prompt ids and the sampling parameters vLLM's chat
route would have built (`request`), with ``output_mode: "derender"`` and the
request's ``parse_context``, so vLLM samples, then parses the answer with
its own ``--tool-call-parser`` / ``--reasoning-parser`` in the same call.
A tool-call constraint only vLLM can build (a structural tag) is first asked
of the worker's ``/v1/chat/completions/render``.
The answer is checked strictly (`answer`) and the agent is answered with
the chat completion the SGLang engines write (`reply`).

A completion the worker aborted (a weight update, a pause) is continued
from prompt + partial ids on the same route; the continuation's own parse
sees only its part, so the whole stitched completion is parsed again by the
worker's ``/v1/chat/completions/derender`` (docs/research/vllm-0.33-derender.md).
A grammar-constrained completion is not continued (`CannotContinue`: the
worker would start its grammar over). docs/engines.md#vllm has the choice
of route and its evidence.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

import msgspec
import trio

from ...errors import UpstreamError, UpstreamMalformed
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
from ..pool import Check, Sent, WorkerPool, WorkerRequest
from ..sampling import applied
from ..served_model import ServedModel
from ..stitch import Stitched, reported_spans, stitch, to_continue, version_spans
from .answer import VllmAnswer, check_derendered, check_vllm_answer
from .reply import chat_completion, error_reply
from .request import (
    Untranslatable,
    VllmOptions,
    derender_body,
    effective_default,
    generate_body,
    model_options,
    parser_constrains,
    read_sampling_defaults,
    render_body,
    sampling_params,
)
from .worker import GENERATE_PATH, RENDER_PATH, SAMPLING_DEFAULTS

DERENDER_PATH = "/v1/chat/completions/derender"

logger = logging.getLogger("rollout_session")


@dataclass(frozen=True, slots=True)
class _Continuing:
    """What continuing a vllm completion needs: the turn's first request
    (its prompt, its own limits) and the answer so far."""

    first: EngineRequest
    answer: VllmAnswer


class _RenderedSampling(msgspec.Struct):
    structured_outputs: dict[str, Any] | None = None


class _Rendered(msgspec.Struct):
    """What is read of /render's GenerateRequest (the prompt ids are skipped)."""

    sampling_params: _RenderedSampling


_RENDERED = msgspec.json.Decoder(_Rendered)


def _read_rendered(body: bytes, _: None) -> dict[str, Any] | None:
    """The tool-call constraint in /render's answer (None: it builds none)."""
    try:
        rendered = _RENDERED.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise UpstreamMalformed(
            f"the worker's {RENDER_PATH} answer is not a GenerateRequest: {exc}",
            kind="render",
        ) from None
    return rendered.sampling_params.structured_outputs


__all__ = ["VllmEngine"]


@dataclass(slots=True)
class VllmEngine:
    pool: WorkerPool  # the session's sticky worker, failover, checks, circuit breaker
    model: ServedModel
    options: VllmOptions = field(default_factory=VllmOptions)
    # The workers' launch settings (`spec.Launch`): their chat-route sampling
    # defaults as their rendering of a request shows them (None: not read;
    # the model's files are, until a pool started without workers learns
    # them from the first it admits).
    launch: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    _adopted: Mapping[str, Any] | None = field(default=None, init=False)

    can_continue: ClassVar[bool] = True

    async def complete(
        self, session: EngineSession, request: EngineRequest
    ) -> Completion | Refusal:
        before = request.partial.engine_state if request.partial is not None else None
        if request.partial is not None and not isinstance(before, _Continuing):
            raise CannotContinue("the partial completion is not a vllm answer")
        request_id = uuid.uuid4().hex
        upstream = self.model.upstream_name(request.params.get("model"))
        self._adopt_learned()
        try:
            sampling = sampling_params(request, self.options, self.model.context_length)
        except Untranslatable as exc:
            return Refusal(error_reply(400, str(exc), exc.param), session.worker or "")
        constrained = parser_constrains(request.params, self.options.parsers)
        if before is not None and (constrained or sampling.get("structured_outputs")):
            raise CannotContinue(
                "a grammar-constrained completion cannot be continued: the worker would "
                "start its grammar over"
            )
        if constrained:
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
        sent = await self.pool.send(
            session,
            WorkerRequest(
                path=GENERATE_PATH,
                body=payload,
                request_id=request_id,
                resend_if_gone=before is not None,
                check=Check(check_vllm_answer, AnswerCheck.of(request)),
            ),
        )
        reply = sent.reply
        if reply.status != 200:
            # vLLM's own error, already in the OpenAI shape; nothing is committed.
            return Refusal(AgentReply(reply.status, reply.headers, reply.body), reply.worker)
        answer = sent.checked
        cached = answer.cached_tokens  # this request's, not the stitched answer's
        spans = version_spans(answer.weight_versions, answer.weight_version, len(answer.ids))
        stitched = stitch(request, answer.ids, answer.logprobs, spans, answer.experts)
        ids, logprobs, spans, experts = stitched
        continued = request.aborts_continue and answer.finish_reason == "abort"
        state = _Continuing(request, answer)
        if before is not None:
            answer = _joined(before.answer, answer, stitched)
            if not continued:
                # The continuation's own parse saw only its part.
                answer = await self._derender(session, reply.worker, before.first, answer, upstream)
            state = _Continuing(before.first, answer)
        model = answer.model or upstream or "default"
        if continued:
            return to_continue(
                stitched,
                cached_tokens=cached,
                model=model,
                worker=reply.served_by,
                latency_s=reply.latency_s,
                engine_state=state,
                sampling=applied(sampling),
            )
        include_reasoning = request.params.get("include_reasoning") is not False
        body = chat_completion(
            f"chatcmpl-{request_id}", model, answer, include_reasoning=include_reasoning
        )
        return Completion(
            ids=ids,
            logprobs=logprobs,
            content=answer.content or "",  # as the reply has it (never null)
            tool_calls=answer.tool_calls,
            reasoning_content=answer.reasoning,
            finish_reason=answer.finish_reason,
            model=model,
            weight_versions=spans,
            cached_tokens=cached,
            experts=experts,
            worker=reply.served_by,
            latency_s=reply.latency_s,
            reply=AgentReply(200, [(b"content-type", b"application/json")], body),
            engine_state=state,
            sampling=applied(sampling),
        )

    async def _derender(
        self,
        session: EngineSession,
        worker: str,
        first: EngineRequest,
        answer: VllmAnswer,
        model: str | None,
    ) -> VllmAnswer:
        """`answer` (stitched) parsed as one by the worker's own derender
        route, as an uninterrupted request's answer would have been."""
        payload = derender_body(
            first,
            request_id=uuid.uuid4().hex,
            ids=answer.ids,
            finish_reason=answer.finish_reason,
            stop_reason=answer.stop_reason,
            model=model,
        )
        sent: Sent[None] = await self.pool.send(
            session, WorkerRequest(path=DERENDER_PATH, body=payload, worker=worker)
        )
        reply = sent.reply
        if reply.status != 200:
            raise UpstreamError(
                f"the worker's {DERENDER_PATH} answered {reply.status}: "
                f"{reply.body[:300].decode('utf-8', 'replace')}"
            )
        parsed = check_derendered(reply.body)
        return replace(
            answer,
            content=parsed.content,
            reasoning=parsed.reasoning,
            tool_calls=parsed.tool_calls,
            finish_reason=parsed.finish_reason,
        )

    async def _constraint(
        self, session: EngineSession, request: EngineRequest, model: str | None
    ) -> dict[str, Any] | Refusal | None:
        """The tool-call constraint vLLM's chat route builds for this request
        (its parsers' adjust_request, xgrammar's structural tag), from the
        session's worker's ``/v1/chat/completions/render``; its refusal as
        the agent's answer."""
        sent = await self.pool.send(
            session,
            WorkerRequest(
                path=RENDER_PATH,
                body=render_body(request, model),
                check=Check(_read_rendered, None),
            ),
        )
        reply = sent.reply
        if reply.status != 200:
            return Refusal(AgentReply(reply.status, reply.headers, reply.body), reply.worker)
        return sent.answer

    async def prepare(self, tokenizer: ChatTokenizer) -> None:
        """The sampling defaults of vLLM's chat route: the workers' own, as
        their rendering of a request shows them (a generation-config
        override included; a difference from the model's files is logged),
        else read from the model's generation_config."""
        parsers, path = self.options.parsers, tokenizer.name_or_path
        defaults = self.launch.get(SAMPLING_DEFAULTS)
        if defaults is None:
            self.options = await trio.to_thread.run_sync(model_options, parsers, path)
            return
        files = await trio.to_thread.run_sync(read_sampling_defaults, path)
        differ = {
            key: (effective_default(files, key), value)
            for key, value in defaults.items()
            if effective_default(files, key) != value
        }
        if differ:
            logger.info(
                "vllm: the workers' chat route samples with %s, where the model's "
                "generation_config.json gives %s (a --generation-config or "
                "--override-generation-config): the workers' own defaults are used",
                ", ".join(f"{k}={v[1]}" for k, v in differ.items()),
                ", ".join(f"{k}={v[0]}" for k, v in differ.items()),
            )
        self.options = VllmOptions(parsers, dict(defaults))
        self._adopted = defaults

    def _adopt_learned(self) -> None:
        """The workers' defaults once the pool learned them (a server started
        without workers: the first admitted worker's), instead of the model's
        files: every worker of the pool then runs the same."""
        defaults = self.launch.get(SAMPLING_DEFAULTS)
        if defaults is not None and defaults is not self._adopted:
            self.options = VllmOptions(self.options.parsers, dict(defaults))
            self._adopted = defaults
            logger.info(
                "vllm: the workers' chat route samples with %s: used for every turn",
                ", ".join(f"{k}={v}" for k, v in defaults.items()),
            )

    def counters(self) -> Iterable[EngineCounter]:
        return ()

    def adopt(self, session: EngineSession) -> None:
        self.pool.adopt(session)

    def release(self, session: EngineSession) -> None:
        self.pool.release_session(session)

    async def close_worker_sessions(self, sessions: Iterable[EngineSession]) -> None:
        """vLLM keeps no per-session state a server could free."""


def _joined(before: VllmAnswer, after: VllmAnswer, stitched: Stitched) -> VllmAnswer:
    """Both answers as one, unparsed: the stitched tokens and spans, the
    first's prompt (and its cache, as usage reports it), the last's ending."""
    ids, logprobs, spans, experts = stitched
    return replace(
        after,
        ids=ids,
        logprobs=logprobs,
        experts=experts,
        token_texts=before.token_texts + after.token_texts,
        prompt_tokens=before.prompt_tokens,
        cached_tokens=before.cached_tokens,
        weight_versions=reported_spans(spans),
    )
