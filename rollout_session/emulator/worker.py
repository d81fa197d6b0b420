"""The SGLang emulator: configuration, per-server state, and chat handling.

Owns `EmulatorConfig`, the `Emulator` (one per app: tokenizer, fake model,
prefix cache, fault picker, SGLang session table, and the counters/records
tests inspect and wait on), and the handling of one ``/v1/chat/completions``
or ``/generate`` call (request checks, fault selection, session append, cache
lookup, latency, recording) and of ``/open_session`` / ``/close_session``,
or, for a vLLM emulator, of ``/inference/v1/generate`` (checks in
`vllm_generate`, answers in `vllm_answer`) and
``/inference/v1/abort_requests``, independent of HTTP. Every generation
request is in flight in `weights` (the weight version, pauses and aborts
of both engines; its routes in `weight_routes`), and a prompt that
continues the model's own answer is answered with the rest of it
(`_sample`, `continuation`). The
Quart app, its routes and `start_emulator` live in `emulator_app`; what the
model samples and the response JSON in `generation`, the cache model in
`prefix_cache`, the latency (GPU time) model in `gpu`, errors and injected
faults in `faults`.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, SupportsIndex, overload

import orjson
import trio
from transformers import AutoTokenizer

from rollout_session.emulator.config import EmulatorConfig
from rollout_session.emulator.faults import (
    EARLY_FAULTS,
    FAULT_HEADER,
    BadRequest,
    FaultPicker,
    Reply,
    context_length_message,
    early_fault_reply,
    error_body,
    fault_reply,
    vllm_early_fault_reply,
    vllm_fault_reply,
)
from rollout_session.emulator.gpu import GpuModel
from rollout_session.emulator.model.continuation import GenerationPrompts
from rollout_session.emulator.model.generation import (
    Sample,
    SampleSpec,
    Speaker,
    TextModel,
    choose_tools,
    derive_seed,
)
from rollout_session.emulator.model.logprobs import LogprobModel
from rollout_session.emulator.prefix_cache import PrefixCache
from rollout_session.emulator.sglang.answer import chat_response, routed_experts_blob
from rollout_session.emulator.sglang.generate_params import (
    ToolConstraint,
    contract_error,
    fastapi_error,
    lax_true,
    sampling_error,
    structural_tag_constraint,
    tool_constraint,
)
from rollout_session.emulator.sglang.parse_memo import ParseMemo
from rollout_session.emulator.sglang.sessions import SessionError, SessionTable, SessionTurn
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
from rollout_session.emulator.vllm.derender import Detokenizer, SampledAnswers, derender_chat
from rollout_session.emulator.vllm.generate import (
    GenerateRequest,
    VllmError,
    VllmServer,
    check_request,
    not_modelled,
)
from rollout_session.emulator.vllm.generate import (
    error_body as vllm_error_body,
)
from rollout_session.emulator.vllm.render import (
    ChatTemplate,
    generation_sampling_defaults,
    render_chat,
)
from rollout_session.emulator.weights import (
    ABORTED,
    WAITING_ABORTED,
    Run,
    Span,
    Weights,
)
from rollout_session.errors import InvalidRequest
from rollout_session.prompt.messages import normalize_messages
from rollout_session.prompt.tokenizer import generation_stop_ids

__all__ = ["ChatRecord", "Emulator", "EmulatorConfig"]


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_PRIORITY_RANGE = (
    "priority must be a signed 64-bit integer between -9223372036854775808 and 9223372036854775807"
)
# SamplingParams.max_new_tokens's default (a /generate request without it).
_GENERATE_MAX_NEW_TOKENS = 128
# The model's whole answer, whatever the budget (vLLM's route cuts it itself).
_UNBOUNDED = 1 << 62
# Prompt ids before a completion that SGLang's detokenizer decodes it after
# (schedule_batch.py INIT_INCREMENTAL_DETOKENIZATION_OFFSET).
_DETOKENIZE_CONTEXT = 5
# EngineCoreProc._reject_add_while_paused's RequestError, raised as
# RetryableRequestError: 503 ServiceUnavailableError (error_response.py).
_VLLM_PAUSED = "Generation is paused. Please retry after it resumes."


@dataclass(frozen=True)
class ChatRecord:
    """One chat or generate request as received: parsed JSON body (None if unparsable)."""

    body: Any
    arrival: float  # trio.current_time()
    fault: str | None
    session_id: str | None
    # "chat" (/v1/chat/completions), "generate" (/generate),
    # "vllm-generate" (vLLM's /inference/v1/generate; session_id: X-Session-ID)
    # "vllm-render" (vLLM's /v1/chat/completions/render; the same) or
    # "vllm-derender" (its /v1/chat/completions/derender; the same).
    route: str = "chat"
    body_bytes: int = 0  # length of the raw request body
    # Its headers, names lowercased (what a proxy in front passed on).
    headers: Mapping[str, str] = field(default_factory=dict)


class RecordLog(deque[ChatRecord]):
    """The recorded requests, oldest dropped first; a slice is a list."""

    @overload
    def __getitem__(self, index: SupportsIndex) -> ChatRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[ChatRecord]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> ChatRecord | list[ChatRecord]:
        if isinstance(index, slice):
            return list(self)[index]
        return super().__getitem__(index)


def generate_error(message: str, status: int = 400) -> Reply:
    """The error body of SGLang's native routes (``_create_error_response``)."""
    return Reply(status, orjson.dumps({"error": {"message": message}}))


class _Invalid(BadRequest):
    """A field of the wrong type: FastAPI's validation error (flat, type "Bad Request")."""

    def reply(self) -> Reply:
        return _validation_error(str(self))


def _check_priority(body: dict[str, Any]) -> None:
    """SGLang accepts ``priority`` without --enable-priority-scheduling and ignores
    it (``abort_on_priority_when_disabled`` is off by default); it only checks
    the int64 range (``TokenizerManager._set_default_priority``)."""
    value = body.get("priority")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid("priority: Input should be a valid integer")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise BadRequest(_PRIORITY_RANGE)


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{key} must be an integer >= {minimum}")
    return value


def _validation_error(message: str) -> Reply:
    """FastAPI's request validation error as SGLang renders it (flat, 400)."""
    return Reply(400, error_body(message, type_="Bad Request"))


def _check_tool_schemas(tools: Sequence[dict[str, Any]]) -> None:
    """SGLang's ``serving_chat._validate_request`` runs jsonschema's
    ``Draft202012Validator.check_schema`` on each tool's ``parameters``: a
    schema is an object or a boolean, anything else is a 400 (a boolean one
    passes and fails later, in generation: a 500 here as there)."""
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        if parameters is not None and not isinstance(parameters, dict | bool):
            raise BadRequest(
                f"Tool {i} function has invalid 'parameters' schema: {parameters!r} is not "
                "of type 'object', 'boolean'"
            )


def _session_of(body: dict[str, Any]) -> str | None:
    """SGLang's ``session_params.id``, or a plain ``session_id`` field."""
    params = body.get("session_params")
    sid = (params.get("id") if isinstance(params, dict) else None) or body.get("session_id")
    return sid if isinstance(sid, str) and sid else None


class Emulator:
    """State of one emulator server; tests reach it as ``app.extensions["emulator"]``."""

    def __init__(self, config: EmulatorConfig, model: TextModel | None = None) -> None:
        self.config = config
        self.model = model or TextModel(AutoTokenizer.from_pretrained(str(config.tokenizer_path)))
        self.speaker = Speaker(
            self.model,
            self.model.chat_tokenizer(
                config.chat_template, generation_stop_ids(config.tokenizer_path)
            ),
        )
        self.cache = PrefixCache(
            config.cache_capacity_tokens,
            config.cache_block_tokens,
            session_refs=config.enable_session_radix_cache,
        )
        self.gpu = GpuModel(self.cache, on_change=self._notify)
        # The model's logprob of a token in its context, under a weight version
        # (sampled tokens and prompt logprobs alike: `logprobs`).
        self.logprob_model = LogprobModel(config.seed)
        self.faults = FaultPicker(config.fault, config.fault_rate, config.seed)
        self.requests = RecordLog(maxlen=config.record_limit)
        self.received = 0
        self.inflight = 0
        self.completed = 0
        self.cancelled = 0  # handler cancelled before answering: the client went away
        self.endless_ended = 0  # endless_body answers stopped: the client went away
        self.faults_injected: Counter[str] = Counter()
        # SGLang's session controller: lost with the emulator (a worker restart).
        self.sessions = SessionTable(self.model.tokenizer.bos_token_id)
        self.sessions_opened: list[str] = []  # ids of successful /open_session calls
        self.sessions_closed: list[str] = []  # ids of every /close_session call
        # Added to trio's clock for session timeouts: tests move time with `advance_clock`.
        self.clock_offset = 0.0
        # Work and traffic, over chat and generate requests that were served.
        self.bytes_received = 0  # request body bytes (every chat/generate request)
        self.prompt_tokens = 0  # prompt (full context) tokens
        self.cached_tokens = 0  # of those, served from KV (prefix cache or session slot)
        self.prefill_tokens = 0  # of those, computed (prompt - cached)
        # What the parse routes answer: every sample's texts → its parsed message.
        self.parsed = ParseMemo(self._decode)
        # /parse_function_call and /separate_reasoning calls, and how many were refused.
        self.parse_calls: Counter[str] = Counter()
        # Weight version, pause and the requests in flight (`weights`), and,
        # for vLLM, the ids /inference/v1/abort_requests was asked to abort.
        self.weights = Weights(
            engine="vllm" if config.engine == "vllm" else "sglang",
            version=config.weight_version,
            model_path=config.model_name,
            gpu=self.gpu,
            notify=self._notify,
            wait_until=self.wait_until,
            flush_cache=self._flush_cache,
        )
        self.abort_requests: list[str] = []
        # Where a continuation's prompt may split (`continuation`), and the
        # tokens each recognised continuation's prompt carried of its answer.
        self.generation_prompts = GenerationPrompts(self.speaker.template, self.speaker.call_ids(0))
        self.continued: list[int] = []
        self.vllm = VllmServer(
            model_name=config.model_name,
            context_length=config.context_length,
            vocab_size=self.model.vocab_size,
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
            generation_max_tokens=_generation_max_tokens(config.tokenizer_path),
            sampling_defaults=generation_sampling_defaults(config.tokenizer_path),
        )
        # What /v1/chat/completions/render renders with (vLLM's HF renderer).
        self.chat_template = ChatTemplate(
            self.model.tokenizer, str(self.speaker.template.chat_template)
        )
        self._extra_eos = frozenset(generation_stop_ids(config.tokenizer_path) or ())
        self._token_texts: dict[int, str] = {}
        # What /v1/chat/completions/derender parses: the token route's whole answers.
        self.vllm_answers = SampledAnswers(self._decode)
        self.vllm_detokenizer = Detokenizer(
            decode=self._decode,
            token_text=self._token_text,
            eos_token_id=self.model.tokenizer.eos_token_id,
            generation_eos_ids=self._extra_eos,
            vocab_size=self.model.vocab_size,
        )
        self._changed = trio.Event()

    # -- observability -------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; re-checked after every state change."""
        while not predicate():
            await self._changed.wait()

    @property
    def aborted(self) -> int:
        """Requests an abort ended (any route, either engine)."""
        return self.weights.aborted

    @property
    def weight_version(self) -> str:
        """The label the worker samples under now (what answers report)."""
        return self.weights.version

    @property
    def paused(self) -> bool:
        return self.weights.paused

    @property
    def held(self) -> int:
        """SGLang requests waiting at the pause gate or for a weight update."""
        return self.weights.held

    @property
    def running(self) -> set[str]:
        """Keys of the generation requests in flight: SGLang rids, vLLM
        engine ids (what the abort routes match)."""
        return self.weights.running()

    def _flush_cache(self) -> None:
        """The radix cache reset (SGLang's ``flush_cache``, vLLM's
        ``reset_prefix_cache``): a new, empty cache; the open sessions'
        references and held KV carry over."""
        cfg = self.config
        cache = PrefixCache(
            cfg.cache_capacity_tokens,
            cfg.cache_block_tokens,
            session_refs=cfg.enable_session_radix_cache,
        )
        if cache.session_refs:
            for sid in self.sessions.stats()["sessions"]:
                cache.open_session(sid)
        cache.reserve(self.sessions.held_tokens)
        self.cache = self.gpu.cache = cache

    def note_endless_end(self) -> None:
        self.endless_ended += 1
        self._notify()

    async def wait_for_requests(self, n: int) -> None:
        await self.wait_until(lambda: self.received >= n)

    async def wait_for_completed(self, n: int) -> None:
        await self.wait_until(lambda: self.completed >= n)

    async def wait_for_cancelled(self, n: int) -> None:
        await self.wait_until(lambda: self.cancelled >= n)

    def stats(self) -> dict[str, Any]:
        self._reap()
        return {
            "received": self.received,
            "inflight": self.inflight,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "endless_ended": self.endless_ended,
            "faults_injected": dict(self.faults_injected),
            "open_sessions": sorted(self.open_sessions),
            "sessions_opened": self.sessions_opened,
            "sessions_closed": self.sessions_closed,
            "kv_sessions": self.sessions.stats(),
            "bytes_received": self.bytes_received,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tokens": self.prefill_tokens,
            "parse_calls": dict(self.parse_calls),
            "abort_requests": list(self.abort_requests),
            "aborted": self.aborted,
            "continued": list(self.continued),
            "weights": self.weights.stats(),
            "cache_used_tokens": self.cache.used_tokens,
            "cache_referenced_tokens": self.cache.referenced_tokens,
            "gpu": self.gpu.stats(),
        }

    # -- sessions ------------------------------------------------------------

    @property
    def open_sessions(self) -> set[str]:
        """Ids of the sessions SGLang would hold now (timed-out ones reaped)."""
        self._reap()
        return {sid for sid in self.sessions.stats()["sessions"]}

    def now(self) -> float:
        """The emulator's clock for session timeouts."""
        return trio.current_time() + self.clock_offset

    def advance_clock(self, seconds: float) -> None:
        """Move the session clock forward (and reap what timed out), no sleeping."""
        self.clock_offset += seconds
        self._reap()

    def _reap(self) -> None:
        """``SessionController.maybe_reap`` (SGLang runs it about once a second;
        the emulator before anything that could observe a session)."""
        before = (len(self.sessions), self.sessions.held_tokens)
        for sid in self.sessions.reap(self.now()):
            self.cache.release_session(sid)  # SessionController._close
        self._sessions_changed(before)

    def _sessions_changed(self, before: tuple[int, int] | None = None) -> None:
        held = self.sessions.held_tokens
        self.cache.reserve(held)
        if before is None or before != (len(self.sessions), held):
            self._notify()

    def open_session(self, raw: bytes) -> Reply:
        """``/open_session``: the new id as a JSON string, or SGLang's refusal."""
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        self._reap()
        if not isinstance(body, dict):
            return _validation_error("body: Input should be a valid dictionary")
        capacity = body.get("capacity_of_str_len")
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            return _validation_error("capacity_of_str_len: Field required (an integer)")
        sid, streaming, timeout = (
            body.get("session_id"),
            body.get("streaming"),
            body.get("timeout"),
        )
        if sid is not None and not isinstance(sid, str):
            return _validation_error("session_id: Input should be a valid string")
        if streaming is not None and not isinstance(streaming, bool):
            return _validation_error("streaming: Input should be a valid boolean")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float | None):
            return _validation_error("timeout: Input should be a valid number")
        if streaming and not self.config.enable_streaming_session:
            return generate_error(
                "Streaming sessions are disabled. Please relaunch with --enable-streaming-session."
            )
        opened = self.sessions.open(
            sid, capacity, bool(streaming), None if timeout is None else float(timeout), self.now()
        )
        if opened is None:
            return generate_error(
                "Failed to open the session. Check if a session with the same id is still open."
            )
        self.sessions_opened.append(opened)
        if self.cache.session_refs:
            self.cache.open_session(opened)  # Scheduler.open_session
        self._notify()
        return Reply(200, orjson.dumps(opened))

    def close_session(self, raw: bytes) -> Reply:
        """``/close_session``: 200 with an empty body, whether or not the id is open."""
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        sid = body.get("session_id") if isinstance(body, dict) else None
        if not isinstance(sid, str):
            return _validation_error("session_id: Field required")
        self._reap()
        self.sessions_closed.append(sid)
        # Scheduler.close_session: with --enable-session-radix-cache the id's
        # references go (its blocks stay cached); without it an id that was
        # never opened is only a logged warning in SGLang.
        self.cache.release_session(sid)
        self.sessions.close(sid)
        self._sessions_changed()
        self._notify()
        return Reply(200, b"")

    # -- chat completions ----------------------------------------------------

    def _record(self, record: ChatRecord) -> None:
        """A request as it arrived (before it is checked): recorded and counted."""
        self.requests.append(record)
        self.received += 1
        self.bytes_received += record.body_bytes
        self._notify()

    async def handle_chat(
        self, raw: bytes, fault_header: str | None, headers: Mapping[str, str] | None = None
    ) -> Reply:
        """One ``/v1/chat/completions`` call, counted as completed or cancelled."""
        return await self._counted(self._chat(raw, fault_header, headers or {}))

    async def handle_generate(self, raw: bytes) -> Reply:
        """One ``/generate`` call, counted as completed or cancelled."""
        return await self._counted(self._generate(raw))

    async def _counted(self, call: Awaitable[Reply]) -> Reply:
        self.inflight += 1
        self._notify()
        try:
            reply = await call
        except trio.Cancelled:
            self.cancelled += 1
            raise
        else:
            self.completed += 1
            return reply
        finally:
            self.inflight -= 1
            self._notify()

    async def _chat(
        self, raw: bytes, fault_header: str | None, headers: Mapping[str, str]
    ) -> Reply:
        arrival = trio.current_time()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        session_id = _session_of(body) if isinstance(body, dict) else None
        try:
            fault = self.faults.pick(fault_header, body)
        except ValueError as exc:
            fault = None
            early: Reply | None = BadRequest(str(exc)).reply()
        else:
            early = None
        self._record(ChatRecord(body, arrival, fault, session_id, "chat", len(raw), headers))
        if early is not None:
            return early
        if fault is not None:
            self.faults_injected[fault] += 1
        if fault is not None and fault in EARLY_FAULTS:
            return await early_fault_reply(fault)
        try:
            response = await self._complete(body, arrival, session_id)
        except BadRequest as exc:
            return exc.reply()
        if fault is None:
            return Reply(200, orjson.dumps(response))
        return fault_reply(fault, response, self.model.vocab_size)

    async def _complete(self, body: Any, arrival: float, session_id: str | None) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("stream"):
            raise BadRequest("the emulator does not stream; send stream: false")
        if body.get("n") not in (None, 1):
            raise BadRequest("n must be 1")
        # SGLang's chat route declares session_params but never passes it on
        # (serving_chat builds GenerateReqInput without it): the prompt is
        # input_ids alone, whatever session it names.
        _check_priority(body)
        tools = body.get("tools") or None
        if tools is not None and not (
            isinstance(tools, list)
            and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
            and all(isinstance(t["function"].get("name"), str) for t in tools)
        ):
            raise BadRequest("tools must be a list of {type: function, function: {name, ...}}")
        _check_tool_schemas(tools or ())
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        try:
            if "messages" in body:
                normalize_messages(body["messages"])  # SGLang validates them; the model reads ids
        except InvalidRequest as exc:
            raise BadRequest(exc.message) from exc
        prompt = self._prompt_ids(body.get("input_ids"))
        max_tokens = _opt_int(body, "max_completion_tokens", 1) or _opt_int(body, "max_tokens", 1)
        cfg = self.config
        budget = max(1, cfg.context_length - len(prompt)) if max_tokens is None else max_tokens
        if len(prompt) + budget > cfg.context_length:
            raise BadRequest(context_length_message(cfg.context_length, len(prompt), budget))
        seed = _opt_int(body, "seed", -(2**63))
        sample = self._sample(prompt, seed, budget, _chat_tool_choice(body))
        self._routed_experts(body, prompt, sample)  # a bad start is refused before any work

        # serving_chat passes the top-level session_id on (session_params is dropped).
        hint = body.get("session_id")
        ref = self.cache.session_ref(hint if isinstance(hint, str) else None)
        given_rid = body.get("rid")
        rid = given_rid if isinstance(given_rid, str) else uuid.uuid4().hex
        await self.weights.admit_sglang(rid)
        with self.weights.run(rid, "sglang") as run:
            await self.gpu.serve(cfg, prompt, sample.ids, ref, progress=run.progress)
        answer, spans = self._settle(run, prompt, sample)
        cached = run.progress.cached
        self._count_work(len(prompt), cached)
        waiting = run.abort is not None and run.abort.waiting
        return chat_response(
            answer,
            rid=rid,
            # SGLang echoes the request's `model` ("default" when it has none).
            model=body["model"] if isinstance(body.get("model"), str) else "default",
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            weight_version=spans[-1].version,
            e2e_latency=trio.current_time() - arrival,
            routed_experts=None if waiting else self._routed_experts(body, prompt, answer),
            meta_info=body.get("return_meta_info") is True,
            weight_versions=_reported_spans(spans),
            num_retractions=run.progress.retractions,
            waiting_abort=waiting,
        )

    def _settle(self, run: Run, prompt: Sequence[int], sample: Sample) -> tuple[Sample, list[Span]]:
        """What an SGLang request answers once its run ended: the sample, or
        the tokens an abort left of it (`weights`), with the version spans
        and each token's logprob under the policy that sampled it."""
        abort = run.abort
        if abort is not None:
            finish = WAITING_ABORTED if abort.waiting else ABORTED
            if sample.ids:
                sample = self.speaker.segment(sample, 0, abort.tokens, dict(finish))
                self.parsed.note(_text_ids(sample), sample.message)
            else:  # prefill only: nothing sampled to cut
                sample = replace(sample, finish=dict(finish))
            if not abort.waiting:
                # It finished (aborted): its KV stays in the radix cache.
                self.cache.insert([*prompt, *sample.ids])
        spans = self.weights.spans(run, len(sample.ids))
        return replace(sample, logprobs=self._policy(prompt, sample.ids, spans)), spans

    def _policy(
        self, prompt: Sequence[int], ids: Sequence[int], spans: Sequence[Span]
    ) -> list[float]:
        """The logprobs of the answer ``ids`` after ``prompt``, each token's
        under the weight version that sampled it (its span's): the model's
        logprob of it in context (`LogprobModel`), which a prefill of the
        same ids under that version reports too."""
        versions = [(span.version, span.start, span.end) for span in spans]
        return self.logprob_model.sampled(prompt, ids, versions)

    def _sample(
        self,
        prompt: list[int],
        seed: int | None,
        budget: int,
        constraint: ToolConstraint,
        *,
        note: bool = True,
    ) -> Sample:
        """The completion the model samples for `prompt`, on every route:
        what it decides is read from the prompt ids alone (and the tool call
        a grammar forces). Noted for the parse routes (SGLang's).

        A prompt ``P + S[:k]`` that continues the answer ``S`` the model
        samples for ``P`` (same seed and constraint; ``0 < k < len(S)``) is
        answered with ``S[k:]``, cut to ``budget`` (`continuation`): the
        split candidates are where the prompt's last generation prompts
        end. Its sample is a piece of ``S`` (``Sample.whole``, ``offset`` k)."""
        for split in self.generation_prompts.split_points(prompt):
            rest = prompt[split:]
            try:
                whole = self._draw(prompt[:split], seed, _UNBOUNDED, constraint)
            except BadRequest:
                continue
            k = len(rest)
            if k < len(whole.ids) and whole.ids[:k] == rest:
                end = min(len(whole.ids), k + budget)
                finish = dict(whole.finish)
                if end < len(whole.ids):
                    finish = {"type": "length", "length": budget}
                sample = self.speaker.segment(whole, k, end, finish)
                self.continued.append(k)
                self._notify()
                if note:
                    self.parsed.note(_text_ids(whole), whole.message)
                    self.parsed.note(_text_ids(sample), sample.message)
                return sample
        sample = self._draw(prompt, seed, budget, constraint)
        if note:
            self.parsed.note(_text_ids(sample), sample.message)
        return sample

    def _draw(
        self, prompt: Sequence[int], seed: int | None, budget: int, constraint: ToolConstraint
    ) -> Sample:
        """What the model samples after `prompt` (at most `budget` tokens)."""
        cfg = self.config
        reading = self.speaker.read(prompt)
        reasoning = cfg.reasoning and reading.kwargs.get("enable_thinking", True) is not False
        try:
            calls = choose_tools(reading, constraint.choice, constraint.single)
            return self.speaker.sample(
                SampleSpec(
                    derive_seed(cfg.seed, seed, prompt),
                    budget,
                    cfg.completion_tokens,
                    calls,
                    reasoning,
                ),
                reading,
                # Under the version sampling now; `_settle` rescores a token
                # whose decode step ended under another (its span's).
                lambda ids: self.logprob_model.sampled(
                    prompt, ids, [(self.weights.version, 0, len(ids))]
                ),
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc

    def _count_work(self, prompt_tokens: int, cached: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached
        self.prefill_tokens += prompt_tokens - cached

    # -- /generate -----------------------------------------------------------

    async def _generate(self, raw: bytes) -> Reply:
        arrival = trio.current_time()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        params = body.get("session_params") if isinstance(body, dict) else None
        sid = params.get("id") if isinstance(params, dict) else None
        self._record(
            ChatRecord(
                body, arrival, None, sid if isinstance(sid, str) else None, "generate", len(raw)
            )
        )
        try:
            return await self._generate_checked(body, arrival)
        except _Invalid as exc:
            return exc.reply()
        except BadRequest as exc:
            return generate_error(str(exc))
        except SessionError as exc:
            return generate_error(str(exc))

    async def _generate_checked(self, body: Any, arrival: float) -> Reply:
        cfg = self.config
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        # SGLang's order: FastAPI's parse, the contract gate, then the
        # tokenizer manager's checks (generate_params).
        invalid = fastapi_error(body)
        if invalid is not None:
            raise _Invalid(invalid)
        contract = contract_error(body)
        if contract is not None:
            return Reply(400, orjson.dumps({"error": contract}))
        if body.get("stream"):
            raise BadRequest("the emulator does not stream; send stream: false")
        sampling: dict[str, Any] = body.get("sampling_params") or {}
        _refuse_unmodelled(body, sampling)
        params = body.get("session_params")
        if body.get("session_id") is not None and params is not None:
            raise BadRequest("session_id and session_params cannot both be set.")
        ids = body.get("input_ids")
        vocab = self.model.vocab_size
        if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids)):
            raise BadRequest(
                f"input_ids must be a list of ids in [0, {vocab}) "
                "(the emulator never tokenizes text)"
            )
        if not ids and not (params and params.get("id")):
            raise BadRequest("input_ids cannot be empty.")
        # Omitted: SamplingParams' default 128; null: no limit (the context).
        max_new: int | None = sampling.get("max_new_tokens", _GENERATE_MAX_NEW_TOKENS)
        # Checked only when sent (the tokenizer manager reads the request's dict).
        _check_lengths(cfg.context_length, len(ids), sampling.get("max_new_tokens"))
        error = sampling_error(sampling, vocab)
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
        _check_priority(body)
        given_rid = body.get("rid")
        rid = given_rid if isinstance(given_rid, str) else uuid.uuid4().hex
        self._reap()
        turn: SessionTurn | None = None
        prompt: list[int] = ids
        if params is not None and params.get("id") is not None:
            # Non-streaming sessions keep output[:max_new_tokens] (no limit: all).
            kept = max_new if max_new is not None else cfg.context_length
            turn = self.sessions.create(params, rid, ids, kept, self.now())
            prompt = turn.turn.context
            self._sessions_changed()  # tests wait for the turn to be in flight
        try:
            sample, run = await self._run(body, sampling, prompt, turn, max_new, rid)
        except BaseException:
            if turn is not None:
                self.sessions.abort(turn)
                self._sessions_changed()
            raise
        answer, spans = self._settle(run, prompt, sample)
        if turn is not None:
            if run.abort is None:
                self.sessions.finish(turn, sample.ids)
            else:  # an aborted turn is not appended to its session
                self.sessions.abort(turn)
            self._sessions_changed()
        cached = run.progress.cached
        self._count_work(len(prompt), cached)
        start = _logprob_start(body, prompt, turn)
        meta = self._generate_meta(body, rid, prompt, answer, run, spans, cached, arrival, start)
        skip = sampling.get("skip_special_tokens")
        text = self._detokenize(
            prompt,
            answer.ids if sampling.get("no_stop_trim") else _text_ids(answer),
            skip is not False,
        )
        out: dict[str, Any] = {"text": text, "output_ids": answer.ids, "meta_info": meta}
        if body.get("return_prompt_token_ids"):
            out["prompt_token_ids"] = ids  # the request's own ids, as tokenized
        return Reply(200, orjson.dumps(out))

    def _generate_meta(
        self,
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
        reported = _reported_spans(spans)
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
            with_text = body.get("return_text_in_logprobs") is True
            texts: list[str | None] = (
                list(self.speaker.template.decode_pieces(sample.ids)) if with_text else [None] * n
            )
            # The prefill's (its weights are the first token's: spans[0]); a
            # request aborted in the waiting queue was never prefilled.
            meta["input_token_logprobs"] = (
                []
                if waiting or start is None
                else self._input_logprobs(prompt, start, spans[0].version, with_text)
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
            reasoning_tokens=sample.reasoning_tokens,
            completion_tokens=n,
            cached_tokens=cached,
        )
        if reported is not None:
            meta["weight_versions"] = reported
        routed = self._routed_experts(body, prompt, sample)
        if routed is not None:
            meta["routed_experts"] = routed
        meta["e2e_latency"] = trio.current_time() - arrival
        return meta

    def _input_logprobs(
        self, prompt: list[int], start: int, version: str, with_text: bool
    ) -> list[list[Any]]:
        """SGLang's ``input_token_logprobs`` from ``logprob_start_len`` ``start``:
        ``[logprob, id, text]`` for the prompt tokens ``start..n-1``, the
        first always ``[null, id, text]`` (``_process_input_token_logprobs``:
        ``[None] + input_token_logprobs[:-1]``), the rest the model's
        logprob of each token after the ones before it (`LogprobModel`)."""
        ids = prompt[start:]
        if not ids:
            return []
        values: list[float | None] = [None]
        values.extend(self.logprob_model.score(prompt, version, start + 1).logprobs())
        if not with_text:
            return [[lp, tok, None] for lp, tok in zip(values, ids, strict=True)]
        texts = self.speaker.template.decode_pieces(ids)
        return [list(entry) for entry in zip(values, ids, texts, strict=True)]

    def _detokenize(self, prompt: Sequence[int], ids: Sequence[int], skip: bool) -> str:
        """The detokenizer's text of a completion: decoded after the last
        prompt ids (``Req.init_incremental_detokenize``'s surrounding
        offset; DetokenizerManager keeps what follows their text)."""
        context = list(prompt[-_DETOKENIZE_CONTEXT:])
        if not context:
            return self._decode(ids, skip)
        head = self._decode(context, skip)
        return self._decode([*context, *ids], skip)[len(head) :]

    async def _run(
        self,
        body: dict[str, Any],
        sampling: dict[str, Any],
        prompt: list[int],
        turn: SessionTurn | None,
        max_new: int | None,
        rid: str,
    ) -> tuple[Sample, Run]:
        """Sample and wait the GPU time of one /generate request, once past
        the pause gate: (sample, its run)."""
        cfg = self.config
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
            sample = self._sample(prompt, sampling.get("sampling_seed"), budget, constraint)
            self._routed_experts(body, prompt, sample)  # a bad start is refused before any work
        start = _logprob_start(body, prompt, turn)
        # Req._compute_max_prefix_len: the cache serves at most logprob_start_len tokens.
        reuse = start if start is not None and start < len(prompt) else None
        await self.weights.admit_sglang(rid)
        with self.weights.run(rid, "sglang") as run:
            if turn is None or not turn.streaming:
                # A radix-native session (top-level session_id) or a non-streaming
                # session_params session: both reference their KV under the flag.
                hint = body.get("session_id") if turn is None else turn.session_id
                ref = self.cache.session_ref(hint if isinstance(hint, str) else None)
                await self.gpu.serve(
                    cfg, prompt, sample.ids, ref, progress=run.progress, reuse=reuse
                )
            else:
                await self.gpu.serve(
                    cfg,
                    prompt,
                    sample.ids,
                    None,
                    held=turn.held_prefix,
                    fill="prompt" if turn.publish else "none",
                    progress=run.progress,
                )
        return sample, run

    def _routed_experts(
        self, body: dict[str, Any], prompt: list[int], sample: Sample
    ) -> str | None:
        """``meta_info.routed_experts`` if the request asks for it (chat and
        /generate alike); raises BadRequest for a start past the positions
        (checked on the whole sample before it is served: an aborted
        answer's shorter one has none then)."""
        if not lax_true(body.get("return_routed_experts")):
            return None
        start_len = _opt_int(body, "routed_experts_start_len", 0) or 0
        forwarded = len(prompt) + len(sample.ids) - 1  # the last sampled token is never forwarded
        if start_len > forwarded:
            if sample.finish.get("type") == "abort":
                return None
            raise BadRequest(f"routed_experts_start_len {start_len} > {forwarded} positions")
        cfg = self.config
        if not cfg.return_routed_experts:
            return None
        return routed_experts_blob(
            (prompt + sample.ids)[:forwarded],
            start_len,
            layers=cfg.routed_experts_layers,
            top_k=cfg.routed_experts_top_k,
            num_experts=cfg.routed_experts_num_experts,
        )

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """The detokenizer's text of `ids` (what /generate answers)."""
        text: str = self.model.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    # -- vLLM: /inference/v1/generate, /inference/v1/abort_requests ---------

    async def handle_vllm_generate(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        """One vLLM ``/inference/v1/generate`` call (``headers`` lowercased),
        counted as completed or cancelled."""
        return await self._counted(self._vllm_generate(raw, headers))

    async def handle_vllm_render(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        """One vLLM ``/v1/chat/completions/render`` call (``headers``
        lowercased), counted as completed or cancelled: the
        ``GenerateRequest`` vLLM's chat route would sample (`vllm_render`).
        Recorded with route "vllm-render"; no GPU time, no fault."""
        return await self._counted(self._vllm_render(raw, headers))

    async def _vllm_render(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        session = headers.get("x-session-id")
        self._record(
            ChatRecord(body, trio.current_time(), None, session, "vllm-render", len(raw), headers)
        )
        try:
            answer = render_chat(
                raw,
                headers.get("content-type", ""),
                headers.get("x-request-id"),
                self.vllm,
                self.chat_template,
            )
        except VllmError as exc:
            return exc.reply()
        return Reply(200, orjson.dumps(answer))

    async def handle_vllm_derender(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        """One vLLM ``/v1/chat/completions/derender`` call (``headers``
        lowercased), counted: the chat completion vLLM's parsers make of a
        token-route answer (`vllm_derender`). Recorded with route
        "vllm-derender"; no GPU time, no fault."""
        return await self._counted(self._vllm_derender(raw, headers))

    async def _vllm_derender(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        session = headers.get("x-session-id")
        self._record(
            ChatRecord(body, trio.current_time(), None, session, "vllm-derender", len(raw), headers)
        )
        return derender_chat(
            raw,
            headers.get("content-type", ""),
            self.vllm,
            self.vllm_detokenizer,
            self.vllm_answers,
        )

    async def _vllm_generate(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        arrival = trio.current_time()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        try:
            fault = self.faults.pick(headers.get(FAULT_HEADER.lower()), body)
        except ValueError as exc:
            fault = None
            early: Reply | None = VllmError(str(exc)).reply()
        else:
            early = None
        session = headers.get("x-session-id")
        self._record(ChatRecord(body, arrival, fault, session, "vllm-generate", len(raw), headers))
        if early is not None:
            return early
        if fault is not None:
            self.faults_injected[fault] += 1
        if fault in ("http_500", "http_400"):
            return vllm_early_fault_reply(fault)
        try:
            request = check_request(raw, headers.get("content-type", ""), self.vllm)
            return await self._vllm_serve(request, headers, arrival, fault)
        except VllmError as exc:
            return exc.reply()

    async def _vllm_serve(
        self,
        request: GenerateRequest,
        headers: Mapping[str, str],
        arrival: float,
        fault: str | None,
    ) -> Reply:
        """Sample, cut where vLLM stops, wait the GPU time (abortable), answer."""
        cfg = self.config
        s = request.sampling
        # BaseServing._base_request_id: X-Request-Id wins over the body's id.
        engine_id = f"generate-tokens-{headers.get('x-request-id') or request.request_id}"
        prompt = request.token_ids
        constraint = json_tool_constraint(s.constraint, request.parse_context)
        try:
            sample = self._sample(prompt, s.seed, _UNBOUNDED, constraint, note=False)
        except BadRequest as exc:
            raise VllmError(str(exc)) from None
        self.vllm_answers.note(sample.whole or sample)
        ended = sample.finish.get("type") == "stop" and isinstance(
            sample.finish.get("matched"), int
        )
        whole_text = self._decode(sample.ids[:-1] if ended else sample.ids, s.skip_special_tokens)
        outcome = mark_whole(
            finish(
                sample.ids,
                sample.logprobs,
                ended,
                s,
                request.max_tokens,
                self._decode,
                self.model.tokenizer.eos_token_id,
                self._extra_eos,
            ),
            whole_text if s.detokenize else "",
        )
        if fault == "abort":  # aborted mid-decode: one token short
            outcome = aborted(outcome, len(outcome.ids) - 1, self._decode, s, whole_text)
        scored = s.prompt_logprobs is not None
        decoded = self._decoded_prompt(prompt) if scored and s.detokenize else None
        if self.weights.refuses_vllm():  # /pause in abort or wait mode
            return VllmError(_VLLM_PAUSED, type_="ServiceUnavailableError", code=503).reply()
        with self.weights.run(engine_id, "vllm") as run:
            if fault == "stall":
                await trio.sleep_forever()
            # Prompt logprobs skip reading the prefix cache (SamplingParams
            # __post_init__: skip_reading_prefix_cache).
            await self.gpu.serve(
                cfg, prompt, outcome.ids, None, progress=run.progress, reuse=0 if scored else None
            )
        cached = run.progress.cached
        if run.abort is not None:  # /inference/v1/abort_requests, /pause, /abort_requests
            outcome = aborted(outcome, run.abort.tokens, self._decode, s, whole_text)
            if run.progress.phase == "decode":
                self.cache.insert([*prompt, *outcome.ids])  # its computed blocks stay cached
        spans = self.weights.spans(run, len(outcome.ids))
        outcome = replace(outcome, logprobs=self._policy(prompt, outcome.ids, spans))
        prompt_logprobs = None
        if scored and (run.abort is None or run.progress.phase in ("decode", "done")):
            # Computed by the prefill, whose weights sampled the first token;
            # an abort before the prefill ended leaves none.
            version = spans[0].version if spans else None
            if version is None and run.abort is not None:
                version = run.abort.version  # vLLM closes an aborted request's label
            prompt_logprobs = self._prompt_logprobs(
                prompt, version or self.weights.version, decoded
            )
        self._count_work(len(prompt), cached)
        return self._vllm_reply(
            request, engine_id, sample.message, outcome, cached, fault, spans, prompt_logprobs
        )

    def _decoded_prompt(self, prompt: list[int]) -> list[str]:
        """``decoded_token`` of each prompt token (``convert_ids_list_to_tokens``:
        ``tokenizer.decode([id])``, no leading-space marker in the emulator's
        byte-level tokenizers); a piece ending in U+FFFD, which vLLM corrects
        from the tokens before it (``LogprobsProcessor._verify_tokens``), is
        refused as not modelled."""
        pieces = [str(p) for p in self.model.tokenizer.batch_decode([[t] for t in prompt[1:]])]
        if any(piece.endswith("\ufffd") for piece in pieces):
            raise not_modelled(
                "prompt logprobs of a prompt with byte-fallback tokens with detokenize: true "
                "(send detokenize: false)",
                "prompt_logprobs",
            )
        return pieces

    def _prompt_logprobs(
        self, prompt: list[int], version: str, decoded: list[str] | None
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs`` for ``prompt_logprobs: 0``: ``None``
        for the first token (``create_prompt_logprobs``), then per position
        ``{"<id>": {"logprob", "rank", "decoded_token"}}``, the prompt token
        alone (``append_logprobs_for_next_position``), its logprob the
        model's (`LogprobModel`; never -inf, so ``clamp_prompt_logprobs``
        changes nothing)."""
        scores = self.logprob_model.score(prompt, version, 1)
        pieces: Sequence[str | None] = decoded if decoded is not None else [None] * len(scores)
        out: list[dict[str, dict[str, Any]] | None] = [None]
        out.extend(
            {str(tok): {"logprob": lp, "rank": rank, "decoded_token": piece}}
            for tok, lp, rank, piece in zip(
                prompt[1:], scores.logprobs(), scores.ranks(), pieces, strict=True
            )
        )
        return out

    def _vllm_reply(
        self,
        request: GenerateRequest,
        engine_id: str,
        sampled_message: Mapping[str, Any],
        outcome: Outcome,
        cached: int,
        fault: str | None,
        spans: Sequence[Span],
        prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None,
    ) -> Reply:
        cfg = self.config
        prompt = request.token_ids
        context = request.derender_context
        message = (
            derender_message(outcome, sampled_message, self.vllm, context)
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
            token=self._token_text,
            prompt_logprobs=prompt_logprobs,
        )
        if fault is None or fault in ("abort", "stall"):
            return Reply(200, orjson.dumps(answer))
        return vllm_fault_reply(fault, answer, self.model.vocab_size)

    def _token_text(self, token: int) -> str:
        """One token's text in a logprob entry (``tokenizer.decode([id])``), memoised."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = str(self.model.tokenizer.decode([token]))
        return text

    @property
    def vllm_running(self) -> set[str]:
        """Engine ids (``generate-tokens-<id>``) of the running vLLM generate
        requests: what /inference/v1/abort_requests can abort now."""
        return {run.key for run in self.weights.runs() if run.engine == "vllm"}

    def vllm_abort_requests(self, raw: bytes) -> Reply:
        """``/inference/v1/abort_requests {request_ids}`` (``api_router.py``
        ``abort_requests``): 200 with an empty body; every running request
        whose engine id (``generate-tokens-<id>``) is listed ends with
        finish_reason "abort" and the tokens it had so far."""
        try:
            body: Any = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            message = f"JSON decode error: {exc}"
            return Reply(400, vllm_error_body(message, "Bad Request", 400))
        if not isinstance(body, dict):  # `body.get` fails: the app's 500
            message = f"'{type(body).__name__}' object has no attribute 'get'"
            return Reply(500, vllm_error_body(message, "InternalServerError", 500))
        ids = body.get("request_ids")
        if ids is None:
            message = "Missing 'request_ids' in request body"
            return Reply(400, vllm_error_body(message, "Bad Request", 400))
        wanted = [ids] if isinstance(ids, str) else [i for i in ids if isinstance(i, str)]
        self.abort_requests.extend(wanted)
        self.weights.abort_keys(wanted, "inference/v1/abort_requests")
        return Reply(200, b"")

    # -- /parse_function_call, /separate_reasoning ---------------------------

    def parse_function_call(self, raw: bytes) -> Reply:
        """``/parse_function_call``: the tool calls of a text the emulator sampled."""
        self.parse_calls["parse_function_call"] += 1
        return self._parse_counted(self.parsed.parse_function_call(raw))

    def separate_reasoning(self, raw: bytes) -> Reply:
        """``/separate_reasoning``: the reasoning of a text the emulator sampled."""
        self.parse_calls["separate_reasoning"] += 1
        return self._parse_counted(self.parsed.separate_reasoning(raw))

    def _parse_counted(self, reply: Reply) -> Reply:
        if reply.status != 200:
            self.parse_calls["refused"] += 1
        self._notify()
        return reply

    def _prompt_ids(self, ids: Any) -> list[int]:
        """The prompt: ``input_ids`` only. SGLang would render ``messages``
        itself; a session server must never rely on that (its prompt must be
        the trajectory's ids), so the emulator refuses to."""
        vocab = self.model.vocab_size
        if ids is None:
            raise BadRequest(
                "input_ids is required (the emulator never renders messages: the session "
                "server must send the trajectory's ids)"
            )
        if not (
            isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < vocab for t in ids)
        ):
            raise BadRequest(f"input_ids must be a non-empty list of ids in [0, {vocab})")
        return ids


def _generation_max_tokens(path: Any) -> int | None:
    """``generation_config.json``'s ``max_new_tokens`` (vLLM's
    ``get_diff_sampling_param`` default ``max_tokens``), or None."""
    try:
        with open(f"{path}/generation_config.json", encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    value = config.get("max_new_tokens") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _chat_tool_choice(body: dict[str, Any]) -> ToolConstraint:
    """The grammar SGLang's chat route builds from `tool_choice`, as the
    tool call it forces: "required" or a named function force a call
    (``get_json_schema_constraint``; ``parallel_tool_calls: false`` allows one),
    "auto" (the default) and "none" force nothing ("none": no call). Checked
    like ``serving_chat._validate_request``."""
    value = body.get("tool_choice")
    names = [t["function"]["name"] for t in body.get("tools") or ()]
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise BadRequest("tool_choice must name a function")
        if not names:
            raise BadRequest("Tools cannot be empty if tool choice is set to a specific tool.")
        if name not in names:
            raise BadRequest(f"Tool '{name}' not found in tools list.")
        return ToolConstraint(name, single=True)
    if value is None:
        return ToolConstraint()
    if value not in ("auto", "none", "required"):
        raise BadRequest(f"tool_choice {value!r} is not auto, none, required or a function")
    if value == "required" and not names:
        raise BadRequest("Tools cannot be empty if tool choice is set to required.")
    return ToolConstraint(
        str(value), single=value == "required" and body.get("parallel_tool_calls") is False
    )


def _reported_spans(spans: Sequence[Span]) -> list[dict[str, Any]] | None:
    """SGLang's ``meta_info.weight_versions`` (and the chat route's
    ``metadata``), reported for an answer that spans a version change.
    SGLang 0.5.23 reports them for every finished answer; the single span
    of an answer sampled under one label says no more than its
    ``weight_version`` (docs/emulator.md#weight-updates)."""
    return [span.json() for span in spans] if len(spans) > 1 else None


def _text_ids(sample: Sample) -> list[int]:
    """The ids /generate's ``text`` decodes: through the stop, the matched stop
    token trimmed (``DetokenizerManager.trim_matched_stop``, no_stop_trim off)."""
    finish = sample.finish
    if finish.get("type") == "stop" and isinstance(finish.get("matched"), int):
        return sample.ids[:-1]
    return sample.ids


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


# Keys a batched /generate request makes lists of (the emulator serves one request per call).
_BATCH_KEYS: Final = (
    "rid", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_hidden_states", "lora_path", "custom_logit_processor",
)  # fmt: skip


def _refuse_unmodelled(body: dict[str, Any], sampling: dict[str, Any]) -> None:
    """What SGLang would answer and the emulator cannot: refused, never faked."""
    for key in ("image_data", "video_data", "audio_data", "input_embeds"):
        if body.get(key) is not None:
            raise BadRequest(f"the emulator serves a text model: {key} is not supported")
    if body.get("text") is not None:
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
