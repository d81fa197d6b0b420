"""One emulator server's engine-neutral state: the core both engines' routes share.

Owns the `Emulator` (one per app: tokenizer, fake model, prefix cache and
GPU time, fault picker, weights clock, the requests received and the
counters tests inspect and wait on) and what every route samples through
it (`Emulator.sample`: the model's completion for prompt ids, a prompt that
continues the model's own answer answered with the rest of it:
`model.continuation`). SGLang's session table lives here too: the prefix
cache reserves what it holds and a cache flush carries it over, so the
cache's bookkeeping spans it (its routes: `sglang.session_routes`).

How a request is handled is each engine's: SGLang's in `sglang/` (chat,
``/generate``, sessions, parse routes), vLLM's in `vllm/` (generate,
render, derender, abort); the Quart app and `start_emulator` in `app`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import trio
from transformers import AutoTokenizer

from rollout_session.emulator.config import EmulatorConfig
from rollout_session.emulator.faults import BadRequest, FaultPicker, Reply
from rollout_session.emulator.gpu import GpuModel
from rollout_session.emulator.model.continuation import GenerationPrompts
from rollout_session.emulator.model.forced_call import ToolConstraint
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
from rollout_session.emulator.records import ChatRecord, RecordLog
from rollout_session.emulator.sglang.sessions import SessionTable
from rollout_session.emulator.weights import Span, Weights
from rollout_session.prompt.tokenizer import generation_stop_ids

__all__ = ["UNBOUNDED", "ChatRecord", "Emulator", "EmulatorConfig"]

# The model's whole answer, whatever the budget (vLLM's route cuts it itself).
UNBOUNDED: Final = 1 << 62


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
        self.gpu = GpuModel(self.cache, on_change=self.notify)
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
        # SGLang's /parse_function_call and /separate_reasoning calls, and how
        # many were refused.
        self.parse_calls: Counter[str] = Counter()
        # Weight version, pause and the requests in flight (`weights`), and,
        # for vLLM, the ids /inference/v1/abort_requests was asked to abort.
        self.weights = Weights(
            engine="vllm" if config.engine == "vllm" else "sglang",
            version=config.weight_version,
            model_path=config.model_name,
            gpu=self.gpu,
            notify=self.notify,
            wait_until=self.wait_until,
            flush_cache=self._flush_cache,
        )
        self.abort_requests: list[str] = []
        # Where a continuation's prompt may split (`continuation`), and the
        # tokens each recognised continuation's prompt carried of its answer.
        self.generation_prompts = GenerationPrompts(self.speaker.template, self.speaker.call_ids(0))
        self.continued: list[int] = []
        self._changed = trio.Event()

    # -- observability -------------------------------------------------------

    def notify(self) -> None:
        """Wake every `wait_until`: some state changed."""
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

    @property
    def vllm_running(self) -> set[str]:
        """Engine ids (``generate-tokens-<id>``) of the running vLLM generate
        requests: what /inference/v1/abort_requests can abort now."""
        return {run.key for run in self.weights.runs() if run.engine == "vllm"}

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
        self.notify()

    async def wait_for_requests(self, n: int) -> None:
        await self.wait_until(lambda: self.received >= n)

    async def wait_for_cancelled(self, n: int) -> None:
        await self.wait_until(lambda: self.cancelled >= n)

    def stats(self) -> dict[str, Any]:
        self.reap()
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

    # -- SGLang's session table and its clock --------------------------------

    @property
    def open_sessions(self) -> set[str]:
        """Ids of the sessions SGLang would hold now (timed-out ones reaped)."""
        self.reap()
        return {sid for sid in self.sessions.stats()["sessions"]}

    def now(self) -> float:
        """The emulator's clock for session timeouts."""
        return trio.current_time() + self.clock_offset

    def advance_clock(self, seconds: float) -> None:
        """Move the session clock forward (and reap what timed out), no sleeping."""
        self.clock_offset += seconds
        self.reap()

    def reap(self) -> None:
        """``SessionController.maybe_reap`` (SGLang runs it about once a second;
        the emulator before anything that could observe a session)."""
        before = (len(self.sessions), self.sessions.held_tokens)
        for sid in self.sessions.reap(self.now()):
            self.cache.release_session(sid)  # SessionController._close
        self.sessions_changed(before)

    def sessions_changed(self, before: tuple[int, int] | None = None) -> None:
        """The cache reserves what the sessions hold now; waiters wake on a change."""
        held = self.sessions.held_tokens
        self.cache.reserve(held)
        if before is None or before != (len(self.sessions), held):
            self.notify()

    # -- requests ------------------------------------------------------------

    def record(self, record: ChatRecord) -> None:
        """A request as it arrived (before it is checked): recorded and counted."""
        self.requests.append(record)
        self.received += 1
        self.bytes_received += record.body_bytes
        self.notify()

    async def counted(self, call: Awaitable[Reply]) -> Reply:
        """Run one generation route's call, counted as completed or cancelled."""
        self.inflight += 1
        self.notify()
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
            self.notify()

    def count_work(self, prompt_tokens: int, cached: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached
        self.prefill_tokens += prompt_tokens - cached

    # -- the model -----------------------------------------------------------

    def sample(
        self, prompt: list[int], seed: int | None, budget: int, constraint: ToolConstraint
    ) -> Sample:
        """The completion the model samples for `prompt`, on every route:
        what it decides is read from the prompt ids alone (and the tool call
        a grammar forces).

        A prompt ``P + S[:k]`` that continues the answer ``S`` the model
        samples for ``P`` (same seed and constraint; ``0 < k < len(S)``) is
        answered with ``S[k:]``, cut to ``budget`` (`continuation`): the
        split candidates are where the prompt's last generation prompts
        end. Its sample is a piece of ``S`` (``Sample.whole``, ``offset`` k)."""
        for split in self.generation_prompts.split_points(prompt):
            rest = prompt[split:]
            try:
                whole = self._draw(prompt[:split], seed, UNBOUNDED, constraint)
            except BadRequest:
                continue
            k = len(rest)
            if k < len(whole.ids) and whole.ids[:k] == rest:
                end = min(len(whole.ids), k + budget)
                finish = dict(whole.finish)
                if end < len(whole.ids):
                    finish = {"type": "length", "length": budget}
                self.continued.append(k)
                self.notify()
                return self.speaker.segment(whole, k, end, finish)
        return self._draw(prompt, seed, budget, constraint)

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
                # Under the version sampling now; the routes rescore a token
                # whose decode step ended under another (its span's: `policy`).
                lambda ids: self.logprob_model.sampled(
                    prompt, ids, [(self.weights.version, 0, len(ids))]
                ),
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc

    def policy(
        self, prompt: Sequence[int], ids: Sequence[int], spans: Sequence[Span]
    ) -> list[float]:
        """The logprobs of the answer ``ids`` after ``prompt``, each token's
        under the weight version that sampled it (its span's): the model's
        logprob of it in context (`LogprobModel`), which a prefill of the
        same ids under that version reports too."""
        versions = [(span.version, span.start, span.end) for span in spans]
        return self.logprob_model.sampled(prompt, ids, versions)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """The detokenizer's text of `ids`."""
        text: str = self.model.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text
