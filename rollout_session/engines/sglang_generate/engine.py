"""The `sglang-generate` engine: one turn through SGLang's native ``/generate``.

The worker is sent the prompt ids and the sampling parameters SGLang's chat
route would have built (`request`); its answer is checked strictly
(`answer`), parsed by SGLang's own parsers on the same worker (`parsers`),
and the agent is answered with the chat completion the chat route would
have written (`reply`).

A completion the worker aborted (a weight update, a pause) is continued
from prompt + partial ids: the two answers' texts are joined and parsed as
one. The worker decodes each answer with the five ids before it as context
(``schedule_batch.Req.init_incremental_detokenize``), so the joined text is
the uninterrupted one wherever the cut fell between characters; a cut inside
a character's bytes, and a grammar-constrained completion (the worker would
start its grammar over), are not continued (`CannotContinue`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

import orjson
import trio

from ...errors import UpstreamError, UpstreamMalformed
from ...prompt.tokenizer import ChatTokenizer
from ...tokens import IdArray, LogprobArray, VersionSpan
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
from ..stitch import reported_spans, stitch, to_continue, version_spans
from .answer import GenerateAnswer, check_generate_answer, check_generate_ids
from .delta import Plan, Rebuild, RemoteSessions, dp_rank, lost_session
from .detokenize import Detokenizer
from .parsers import Parsers
from .reply import ParsedAnswer, chat_completion, error_reply, parse_json_array, tool_call_id
from .request import (
    GenerateOptions,
    ToolChoice,
    Untranslatable,
    generate_body,
    model_options,
    sampling_params,
)
from .workers import GENERATE_PATH

__all__ = ["SGLangGenerateEngine"]

_SEPARATE_REASONING = "/separate_reasoning"
_PARSE_FUNCTION_CALL = "/parse_function_call"
_OPEN_SESSION = "/open_session"
# OpenSessionReqInput.capacity_of_str_len is required; SGLang 0.5.23 stores it
# and never enforces it (session_controller.Session).
_CAPACITY = 1 << 20


@dataclass(slots=True)
class SGLangGenerateEngine:
    pool: WorkerPool  # the session's sticky worker, failover, checks, circuit breaker
    model: ServedModel
    options: GenerateOptions = field(default_factory=lambda: GenerateOptions(Parsers()))
    session_hints: bool = False
    # --kv-sessions delta: worker-side sessions, each turn sends its new ids.
    delta: RemoteSessions | None = None
    # How long a worker keeps an idle worker-side session (its reaper); None: forever.
    remote_timeout_s: float | None = None
    # The workers' launch settings (`spec.Launch`: read per turn, as a pool
    # started without workers learns them from the first it admits).
    launch: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    _dp_sizes: dict[str, int] = field(default_factory=dict, init=False)
    _tokenizer: ChatTokenizer | None = field(default=None, init=False)
    _detokenizer: Detokenizer | None = field(default=None, init=False)

    @property
    def ids_only(self) -> bool:
        """The workers run --skip-tokenizer-init: they answer ids, which this
        engine decodes as SGLang's detokenizer would (`detokenize`)."""
        return bool(self.launch.get("skip_tokenizer_init"))

    can_continue: ClassVar[bool] = True

    async def complete(
        self, session: EngineSession, request: EngineRequest
    ) -> Completion | Refusal:
        parsers = self.options.parsers
        forced = parsers.forces_reasoning(request.template_kwargs)
        rid = uuid.uuid4().hex
        plan: Plan | None = None
        try:
            sampling = sampling_params(request, self.options)
        except Untranslatable as exc:
            return Refusal(error_reply(400, str(exc)), session.worker or "")
        before = _continues(request, sampling)
        if before is not None:
            # The worker session no longer holds what the trajectory will:
            # the next turn rebuilds it.
            self._drop(session)
        elif self.delta is not None:
            plan = await self._plan(session, request)
        try:
            sent = await self._generate(session, request, sampling, rid, forced, plan)
            if sent.reply.status == 400 and plan is not None and self.delta is not None:
                message = _message(sent.reply.body)
                if plan.rebuild is None and lost_session(message):
                    # The worker lost the session (restart, its reaper): prime a
                    # fresh one with the whole prompt, once.
                    plan = await self._plan(session, request, Rebuild.LOST)
                    rid = uuid.uuid4().hex  # a new request, not the refused one again
                    sent = await self._generate(session, request, sampling, rid, forced, plan)
        except UpstreamMalformed:
            if plan is not None:
                # E.g. prompt_tokens not the trajectory's: the worker's context
                # cannot be trusted; the next turn rebuilds it.
                self._drop(session)
            raise
        reply = sent.reply
        if reply.status != 200:
            if plan is not None:
                self._drop(session)
            # The worker's own refusal, in the chat route's error shape.
            return Refusal(error_reply(reply.status, _message(reply.body)), reply.worker)
        answer = sent.checked
        if self.ids_only:
            detokenizer = self._ids_decoder()
            answer = replace(
                answer,
                text=detokenizer.text(
                    request.input_ids[-8:].tolist(),
                    answer.ids.tolist(),
                    answer.finish,
                    skip_special_tokens=sampling["skip_special_tokens"],
                    spaces_between_special_tokens=sampling["spaces_between_special_tokens"],
                ),
                token_texts=detokenizer.token_texts(answer.ids.tolist()),
            )
        if plan is not None and self.delta is not None:
            self.delta.finished(session.id, reply.worker, plan, rid, request.input_ids, answer.ids)
        cached = answer.cached_tokens  # this request's, not the stitched answer's
        spans = version_spans(answer.weight_versions, answer.weight_version, len(answer.ids))
        stitched = stitch(request, answer.ids, answer.logprobs, spans, answer.experts)
        ids, logprobs, spans, experts = stitched
        if before is not None:
            answer = _joined(before, answer, ids, logprobs, spans)
        model = self.model.upstream_name(request.params.get("model")) or "default"
        if request.aborts_continue and answer.finish["type"] == "abort":
            return to_continue(
                stitched,
                cached_tokens=cached,
                model=model,
                worker=reply.served_by,
                latency_s=reply.latency_s,
                engine_state=answer,
                sampling=applied(sampling, _SAMPLING_NAMES),
            )
        parsed = await self._parse(session, reply.worker, request, answer, forced)
        body = chat_completion(rid, model, answer, parsed)
        return Completion(
            ids=ids,
            logprobs=logprobs,
            content=parsed.content,
            tool_calls=parsed.tool_calls,
            reasoning_content=parsed.reasoning,
            finish_reason=parsed.finish["type"],
            model=model,
            weight_versions=spans,
            cached_tokens=cached,
            experts=experts,
            worker=reply.served_by,
            latency_s=reply.latency_s,
            reply=AgentReply(200, [(b"content-type", b"application/json")], body),
            engine_state=answer,
            sampling=applied(sampling, _SAMPLING_NAMES),
        )

    async def _plan(
        self, session: EngineSession, request: EngineRequest, rebuild: Rebuild | None = None
    ) -> Plan:
        """Pin the session, plan its request (a fresh worker session for
        `rebuild`), and open the worker session a plan primes, closing the
        one it replaces."""
        assert self.delta is not None
        url = self.pool.pin(session)
        if rebuild is None:
            plan = self.delta.plan(session.id, url, request.input_ids)
        else:
            plan = self.delta.rebuild(session.id, request.input_ids, rebuild)
        if plan.rebuild is None:
            return plan
        old = self.delta.drop(session.id)
        if old is not None:
            self.pool.close_worker_session(old.worker, old.remote_id)
        body = {"capacity_of_str_len": _CAPACITY, "session_id": plan.remote_id}
        if self.remote_timeout_s is not None:
            body["timeout"] = self.remote_timeout_s
        sent: Sent[None] = await self.pool.send(
            session, WorkerRequest(path=_OPEN_SESSION, body=orjson.dumps(body), worker=url)
        )
        reply = sent.reply
        if reply.status != 200:
            raise UpstreamError(
                f"the worker's {_OPEN_SESSION} answered {reply.status}: {_message(reply.body)}"
            )
        return plan

    async def _dp_size(self, url: str) -> int:
        """The worker's data-parallel size (read once per worker)."""
        size = self._dp_sizes.get(url)
        if size is None:
            value = (await self.pool.server_info(url)).get("dp_size", 1)
            size = value if isinstance(value, int) and value >= 1 else 1
            self._dp_sizes[url] = size
        return size

    async def _generate(
        self,
        session: EngineSession,
        request: EngineRequest,
        sampling: dict[str, Any],
        rid: str,
        forced: bool,
        plan: Plan | None,
    ) -> Sent[GenerateAnswer]:
        rank = None
        if plan is not None and session.worker is not None:
            rank = dp_rank(session.id, await self._dp_size(session.worker))
        payload = generate_body(
            request,
            self.options,
            sampling=sampling,
            rid=rid,
            require_reasoning=forced,
            session_hint=session.id if self.session_hints else None,
            input_ids=None if plan is None else plan.input_ids,
            session_params=None if plan is None else plan.session_params,
            dp_rank=rank,
            model=self.model.upstream_name(request.params.get("model")),
            served_model=self.model.name,
        )
        return await self.pool.send(
            session,
            WorkerRequest(
                path=GENERATE_PATH,
                body=payload,
                request_id=rid,
                resend_if_gone=request.partial is not None,
                check=Check(
                    check_generate_ids if self.ids_only else check_generate_answer,
                    AnswerCheck.of(request),
                ),
            ),
        )

    def _drop(self, session: EngineSession) -> None:
        if self.delta is None:
            return
        old = self.delta.drop(session.id)
        if old is not None:
            self.pool.close_worker_session(old.worker, old.remote_id)

    async def _parse(
        self,
        session: EngineSession,
        worker: str,
        request: EngineRequest,
        answer: GenerateAnswer,
        forced: bool,
    ) -> ParsedAnswer:
        """serving_chat._build_chat_response's order: reasoning, then tool calls."""
        parsers = self.options.parsers
        params = request.params
        text, reasoning = answer.text, None
        finish = dict(answer.finish)
        if parsers.reasoning is not None and params.get("separate_reasoning", True):
            # force_reasoning as a think-start prefix (parsers.py says why it is exact).
            sent = parsers.think_start + text if forced else text
            got = await self._route(
                session,
                worker,
                _SEPARATE_REASONING,
                {"text": sent, "reasoning_parser": parsers.reasoning},
            )
            reasoning = got.get("reasoning_text") or None
            text = got.get("text", "")
        tool_choice = ToolChoice.of(params)
        calls: list[dict[str, Any]] = []
        if parsers.tool_call is not None and tool_choice.active:
            if tool_choice.forced and parsers.parses_required_as_json:
                text, found = parse_json_array(text, finish)
            elif not parsers.may_call(text):
                found = []  # the detector's has_tool_call says no: the text as it is
            else:
                got = await self._route(
                    session,
                    worker,
                    _PARSE_FUNCTION_CALL,
                    {
                        "text": text,
                        "tools": tool_choice.tools,
                        "tool_call_parser": parsers.tool_call,
                    },
                )
                text = got.get("normal_text", "")
                found = got.get("calls") or []
            # Kimi's ids count the history's calls (O(history): only for them).
            history = (
                sum(
                    len(m.get("tool_calls") or [])
                    for m in params.get("messages") or []
                    if m.get("role") == "assistant"
                )
                if found and parsers.kimi_ids
                else 0
            )
            for i, call in enumerate(found):
                calls.append(
                    {
                        "id": tool_call_id(parsers, call, history),
                        "index": i,
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["parameters"]},
                    }
                )
            if calls and finish["type"] == "stop":
                finish = {"type": "tool_calls", "matched": None}
        return ParsedAnswer(text or "", reasoning, calls, finish)

    async def _route(
        self, session: EngineSession, worker: str, path: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        sent: Sent[None] = await self.pool.send(
            session, WorkerRequest(path=path, body=orjson.dumps(body), worker=worker)
        )
        reply = sent.reply
        if reply.status != 200:
            raise UpstreamError(
                f"the worker's {path} answered {reply.status}: {_message(reply.body)}"
            )
        try:
            data = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            raise UpstreamError(f"the worker's {path} answer is not a JSON object")
        return data

    async def prepare(self, tokenizer: ChatTokenizer) -> None:
        """The chat route's generation_config defaults, from the model's files;
        for workers without a tokenizer, the server's decodes their ids."""
        self.options = await trio.to_thread.run_sync(
            model_options, self.options.parsers, tokenizer.name_or_path
        )
        self._tokenizer = tokenizer
        if self.ids_only:  # known at start-up: a parser it cannot serve refuses the start
            self._ids_decoder()

    def _ids_decoder(self) -> Detokenizer:
        if self._detokenizer is None:
            assert self._tokenizer is not None, "prepare() runs before any turn"
            self._detokenizer = Detokenizer(self._tokenizer.hf, self.options.parsers.tool_call)
        return self._detokenizer

    def counters(self) -> Iterable[EngineCounter]:
        delta = self.delta
        if delta is None:
            return
        yield EngineCounter(
            "rollout_kv_session_primes",
            "--kv-sessions delta: worker sessions primed with the whole prompt, by cause "
            "(first, moved, branched, lost, dropped)",
            ("cause",),
            {(cause,): count for cause, count in sorted(delta.rebuilds.items())},
        )
        yield EngineCounter(
            "rollout_kv_delta_turns",
            "--kv-sessions delta: turns that sent only the ids the worker did not hold",
            (),
            {(): delta.delta_turns},
        )

    def adopt(self, session: EngineSession) -> None:
        self.pool.adopt(session)

    def release(self, session: EngineSession) -> None:
        self.pool.release_session(session)
        if self.delta is not None:
            old = self.delta.forget(session.id)
            if old is not None:
                self.pool.close_worker_session(old.worker, old.remote_id)

    async def close_worker_sessions(self, sessions: Iterable[EngineSession]) -> None:
        if self.delta is None:
            await self.pool.close_remote_sessions(sessions)
            return
        await self.pool.close_worker_sessions(
            [(held.worker, held.remote_id) for held in self.delta.held()]
        )


# SamplingParams' names for the keys a turn records (`engines.sampling`).
_SAMPLING_NAMES = {"max_tokens": "max_new_tokens", "seed": "sampling_seed"}
# Sampling keys whose grammar the worker starts at the first sampled token.
_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


def _continues(request: EngineRequest, sampling: dict[str, Any]) -> GenerateAnswer | None:
    """The aborted answer `request` continues (None: it continues none), or
    CannotContinue where joining would not be exact."""
    partial = request.partial
    if partial is None:
        return None
    before = partial.engine_state
    if not isinstance(before, GenerateAnswer):
        raise CannotContinue("the partial completion is not an sglang-generate answer")
    if any(sampling.get(key) for key in _GRAMMARS):
        raise CannotContinue(
            "a grammar-constrained completion cannot be continued: the worker would "
            "start its grammar over"
        )
    if before.text.endswith("\ufffd"):
        raise CannotContinue("the worker stopped inside a character's bytes")
    return before


def _joined(
    before: GenerateAnswer,
    after: GenerateAnswer,
    ids: IdArray,
    logprobs: LogprobArray,
    spans: tuple[VersionSpan, ...],
) -> GenerateAnswer:
    """The answer an uninterrupted request would have given: both answers'
    tokens and text, the first's prompt (and its cache), the last's finish
    and meta_info."""
    return replace(
        after,
        ids=ids,
        logprobs=logprobs,
        token_texts=before.token_texts + after.token_texts,
        text=before.text + after.text,
        prompt_tokens=before.prompt_tokens,
        cached_tokens=before.cached_tokens,  # of that prompt, as usage reports it
        reasoning_tokens=(before.reasoning_tokens or 0) + (after.reasoning_tokens or 0),
        weight_versions=reported_spans(spans),
    )


def _message(body: bytes) -> str:
    """The message of an SGLang error body (either shape), else the body."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", "replace")
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    if isinstance(error, str):
        return error
    message = data.get("message") if isinstance(data, dict) else None
    return message if isinstance(message, str) else body[:500].decode("utf-8", "replace")
