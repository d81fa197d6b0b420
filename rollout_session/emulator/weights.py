"""Weight updates, pauses and aborts: what SGLang 0.5.23 and vLLM 0.33 do to
the requests a worker has in flight, for both of the emulator's engines.

Every generation request (SGLang's ``/v1/chat/completions`` and
``/generate``, vLLM's ``/inference/v1/generate``) is a `Run` while it is in
flight: its GPU `Progress` (`gpu`), the weight-version changes it saw, and
the abort that ended it, if one did. One `Weights` per emulator holds them
and the worker's state: the weight version label, the pause, the requests
held at SGLang's pause gate. The routes that change that state
(`sglang.weight_routes`, `vllm.weight_routes`) call it; what a request's
answer reports is read back from its run (`Weights.spans`, `Weights.finish_version`).

Sources (paths under each package). SGLang: ``srt/entrypoints/http_server.py``
(the routes), ``srt/managers/tokenizer_manager.py`` (TM: ``generate_request``'s
pause gate and ``model_update_lock``, ``abort_request``, ``pause_generation``,
``continue_generation``, ``update_weights_from_disk``, ``_handle_abort_req``),
``srt/managers/tokenizer_control_mixin.py`` (``update_weight_version``),
``srt/managers/scheduler.py`` (SCH: ``abort_request``, ``pause_generation``,
``record_weight_version_change``, ``flush_cache``),
``srt/managers/schedule_batch.py`` (``Req.update_finish_state``, ``FINISH_ABORT``,
``reset_for_retract``), ``srt/utils/weight_versions.py`` (the spans).
vLLM: ``entrypoints/rl/online/api_router.py`` (the RL routes),
``v1/engine/async_llm.py`` (``pause_generation``, ``update_weight_version``),
``v1/engine/core.py`` (``pause_scheduler``, ``pause_generation``,
``_reject_add_while_paused``, ``_attach_weight_version``),
``v1/engine/output_processor.py`` (``track_weight_version``,
``_weight_version_spans``).

The modelled behaviour:

- **Tokens sampled so far** are the tokens whose decode time has elapsed
  (`GpuModel.decoded`). SGLang aborts a running request by setting
  ``to_finish`` (SCH ``abort_request``): it still runs one decode step, so
  its answer keeps one token more than had elapsed (at most the whole
  answer; a request still prefilling keeps the prefill's token), finishing
  ``{"type": "abort", "message": "Aborted", "status_code": null,
  "err_type": null}``. A request still in the waiting queue (its base
  latency, or retracted back to it) is answered at once by the tokenizer
  manager (TM ``_handle_abort_req``) with the tokens it had and a
  ``meta_info`` of ``id``, ``finish_reason`` ``{"type": "abort", "message":
  "Abort in waiting queue"}``, ``weight_version``, ``e2e_latency``,
  (logprobs,) ``completion_tokens`` only. vLLM (``AsyncLLM.abort``, the
  engine's ``finish_requests``) keeps the tokens already output: the ones
  elapsed, never the whole answer.
- **Weight versions**: a label change records, for every request in flight
  that has sampled tokens, the old label and how many (SCH
  ``record_weight_version_change``; vLLM starts a span when tokens arrive
  under a new label, ``track_weight_version``); an answer's spans are those
  changes closed by the label current when it finishes (SGLang's
  ``compute_weight_version_spans`` at the finish; vLLM's label of its last
  output): a token's version is the label current when its decode step
  ended. SGLang's ``meta_info.weight_version`` is the last span's version.
- **Pauses**: SGLang holds every new request at the tokenizer manager's
  gate while paused, in any mode (TM ``generate_request`` waits on
  ``is_pause_cond``), invisible to aborts; ``abort`` aborts everything in
  flight and returns when it has ended; ``retract`` and ``in_place`` stop the
  scheduler (the GPU freezes), ``retract`` also retracts running requests
  (they prefill what they had again after ``/continue_generation``, counted
  in ``meta_info.num_retractions``). vLLM's ``abort`` aborts everything and
  ``wait`` lets it finish (the call returns when nothing is left), both
  refusing new requests with a 503 until ``/resume``; ``keep`` freezes the
  engine and queues new requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import trio

from rollout_session.emulator.gpu import GpuModel, Progress

__all__ = [
    "ABORTED",
    "SGLANG_PAUSE_MODES",
    "VLLM_PAUSE_MODES",
    "WAITING_ABORTED",
    "Abort",
    "AbortCall",
    "Run",
    "Span",
    "Weights",
    "version_spans",
]

Engine = Literal["sglang", "vllm"]
# PauseGenerationReqInput.mode (io_struct.py); vLLM's PauseMode (v1/engine/__init__.py).
SGLANG_PAUSE_MODES: Final = ("abort", "retract", "in_place")
VLLM_PAUSE_MODES: Final = ("abort", "wait", "keep")
# FINISH_ABORT().to_json() (schedule_batch.py): a running request's.
ABORTED: Final = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
# TM _handle_abort_req: a request aborted in the waiting queue.
WAITING_ABORTED: Final = {"type": "abort", "message": "Abort in waiting queue"}
# scheduler_components/weight_updater.py flush_cache_after_weight_update.
FLUSH_REFUSED: Final = (
    "Weights were updated, but the cache was not flushed because requests are still "
    "running or queued. Retract or finish them, then call /flush_cache."
)


@dataclass(frozen=True)
class Abort:
    """How an abort ended a run."""

    cause: str  # the route that aborted it
    tokens: int  # tokens its answer keeps
    elapsed: int  # tokens whose decode time had elapsed at the abort
    waiting: bool  # SGLang: ended in the waiting queue (the tokenizer's short answer)
    # vLLM: the label when it ended (its spans close there); SGLang: None (its
    # answer closes them at the finish, after the decode step it still runs).
    version: str | None


@dataclass(frozen=True)
class AbortCall:
    """One call that aborted requests: the route and how many it ended."""

    cause: str
    ended: int
    at: float  # trio.current_time()


@dataclass(frozen=True)
class Span:
    """Output tokens ``[start, end)`` were sampled under weight ``version``."""

    version: str
    start: int
    end: int

    def json(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start, "end": self.end}


@dataclass(eq=False)
class Run:
    """One generation request in flight."""

    key: str  # SGLang: its rid; vLLM: its engine id (generate-tokens-<id>)
    engine: Engine
    progress: Progress = field(default_factory=Progress)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    # (old version, tokens sampled under it) per label change it saw.
    events: list[tuple[str, int]] = field(default_factory=list)
    abort: Abort | None = None


def version_spans(
    events: Sequence[tuple[str, int]], current: str, n: int, *, keep_empty: bool
) -> list[Span]:
    """The spans of an answer of ``n`` tokens that saw the label changes
    ``events`` and finished under ``current``: each change closes the span
    of the old label at the tokens it had, the finish closes the last;
    equal neighbours merge, a change that added no token adds no span.
    ``keep_empty``: SGLang's ``[current, 0, 0)`` for an answer without
    tokens (vLLM reports none)."""
    spans: list[Span] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1].end:
            continue
        if spans and spans[-1].version == version:
            spans[-1] = Span(version, spans[-1].start, end)
            continue
        spans.append(Span(version, spans[-1].end if spans else 0, end))
    if not keep_empty:
        spans = [s for s in spans if s.end > s.start]
    return spans


class Weights:
    """The weight version, pause and in-flight requests of one emulator."""

    def __init__(
        self,
        *,
        engine: Engine,
        version: str,
        model_path: str,
        gpu: GpuModel,
        notify: Callable[[], None],
        wait_until: Callable[[Callable[[], bool]], Awaitable[None]],
        flush_cache: Callable[[], None],
    ) -> None:
        self.engine: Engine = engine
        self.gpu = gpu
        self._notify = notify
        self._wait_until = wait_until
        self._flush_cache = flush_cache
        # The label the scheduler (SGLang) / engine core (vLLM) samples under:
        # what answers report.
        self.version = version
        # SGLang's tokenizer-manager copy (/model_info, /get_model_info):
        # moved by /update_weight_version and by a successful update from disk.
        self.reported_version = version
        self.model_path = model_path  # SGLang: moved by a successful update from disk
        self.load_format = "auto"  # SGLang's --load-format default
        self.paused = False
        self.pause_mode: str | None = None
        self.versions: list[tuple[str, float]] = []  # (new label, trio time) per change
        self.aborts: list[AbortCall] = []  # every call that aborted requests
        self.aborted = 0  # requests an abort ended, over all calls
        self.retractions = 0  # SGLang requests retracted, over all pauses
        self.rejected = 0  # vLLM requests refused with 503 while paused
        self.cache_flushes = 0
        self.pauses: Counter[str] = Counter()  # pause calls by mode
        self._runs: dict[str, list[Run]] = {}
        self._held: Counter[str] = Counter()  # SGLang: rids waiting at the gate or lock
        self._writers = 0  # SGLang updates from disk holding or awaiting the writer lock

    # -- observability -------------------------------------------------------

    @property
    def held(self) -> int:
        """SGLang requests waiting at the pause gate or for a weight update
        (not yet dispatched: aborts do not see them)."""
        return sum(self._held.values())

    def runs(self) -> list[Run]:
        return [run for runs in self._runs.values() for run in runs]

    def running(self) -> set[str]:
        """Keys (SGLang rids, vLLM engine ids) of the requests in flight."""
        return set(self._runs)

    def stats(self) -> dict[str, Any]:
        return {
            "weight_version": self.version,
            "reported_weight_version": self.reported_version,
            "paused": self.paused,
            "pause_mode": self.pause_mode,
            "frozen": self.gpu.frozen,
            "held": self.held,
            "running": sorted(self._runs),
            "versions": [v for v, _ in self.versions],
            "aborts": [{"cause": a.cause, "ended": a.ended} for a in self.aborts],
            "aborted": self.aborted,
            "retractions": self.retractions,
            "rejected": self.rejected,
            "cache_flushes": self.cache_flushes,
            "pauses": dict(self.pauses),
        }

    # -- runs ------------------------------------------------------------------

    @contextmanager
    def run(self, key: str, engine: Engine) -> Iterator[Run]:
        """A request in flight: registered (aborts and label changes see it)
        until the block ends; an abort cancels the block (check `Run.abort`
        after it)."""
        run = Run(key, engine)
        self._runs.setdefault(key, []).append(run)
        self._notify()
        try:
            with run.scope:
                yield run
        finally:
            runs = self._runs[key]
            runs.remove(run)
            if not runs:
                del self._runs[key]
            self._notify()

    async def admit_sglang(self, rid: str) -> None:
        """TM ``generate_request``: wait while paused (``is_pause_cond``),
        then while a weight update from disk holds or awaits the writer
        lock (``model_update_lock``, writer-preferring)."""
        if not (self.paused or self._writers):
            return
        self._held[rid] += 1
        self._notify()
        try:
            await self._wait_until(lambda: not (self.paused or self._writers))
        finally:
            self._held[rid] -= 1
            if not self._held[rid]:
                del self._held[rid]
            self._notify()

    def refuses_vllm(self) -> bool:
        """``EngineCoreProc._reject_add_while_paused``: after ``/pause`` in
        ``abort`` or ``wait`` mode, until ``/resume``; counted."""
        refused = self.paused and self.pause_mode in ("abort", "wait")
        if refused:
            self.rejected += 1
            self._notify()
        return refused

    def spans(self, run: Run, n: int) -> list[Span]:
        """The version spans of ``run``'s answer of ``n`` tokens, closed now
        (or, for a vLLM abort, at the abort)."""
        current = run.abort.version if run.abort and run.abort.version else self.version
        return version_spans(run.events, current, n, keep_empty=run.engine == "sglang")

    # -- aborts ------------------------------------------------------------------

    def _end(self, run: Run, cause: str) -> bool:
        if run.abort is not None or run.progress.phase == "done":
            return False
        p = run.progress
        elapsed = self.gpu.decoded(p)
        if run.engine == "vllm":
            tokens = min(elapsed, max(0, p.total - 1))
            run.abort = Abort(cause, tokens, elapsed, False, self.version)
        elif p.phase == "queued":
            run.abort = Abort(cause, elapsed, elapsed, True, None)
        else:  # running: one more decode step (to_finish), within the answer
            run.abort = Abort(cause, min(p.total, elapsed + 1), elapsed, False, None)
        run.scope.cancel()
        return True

    def abort(self, runs: Iterable[Run], cause: str) -> int:
        """End ``runs`` (those not ended yet); recorded as one call of ``cause``."""
        ended = sum(self._end(run, cause) for run in list(runs))
        self.aborted += ended
        self.aborts.append(AbortCall(cause, ended, trio.current_time()))
        self._notify()
        return ended

    def abort_keys(self, keys: Iterable[str], cause: str, *, prefix: bool = False) -> int:
        """Abort the runs whose key is one of ``keys`` (``prefix``: starts with one)."""
        wanted = list(keys)
        if prefix:
            runs = [r for r in self.runs() if any(r.key.startswith(k) for k in wanted)]
        else:
            runs = [r for k in dict.fromkeys(wanted) for r in self._runs.get(k, ())]
        return self.abort(runs, cause)

    # -- versions ----------------------------------------------------------------

    def set_version(self, new: str) -> None:
        """A label change: every run in flight with tokens notes the old
        label and its tokens (SCH ``record_weight_version_change``; a vLLM
        request's next output starts a span, ``track_weight_version``)."""
        if new == self.version:
            return
        for run in self.runs():
            if run.abort is not None and run.abort.version is not None:
                continue  # a vLLM abort closed its spans
            done = run.abort.elapsed if run.abort else self.gpu.decoded(run.progress)
            if done:
                run.events.append((self.version, done))
        self.version = new
        self.versions.append((new, trio.current_time()))
        self._notify()

    # -- SGLang's control routes ---------------------------------------------------

    def _idle(self) -> bool:
        """SCH ``is_fully_idle(ignore_waiting=_engine_paused)``: nothing
        running, nothing waiting unless the scheduler is paused."""
        for run in self.runs():
            if run.abort is not None:
                continue
            if run.progress.phase in ("prefill", "decode"):
                return False
            if run.progress.phase == "queued" and not self.gpu.frozen:
                return False
        return True

    def flush(self) -> None:
        self._flush_cache()
        self.cache_flushes += 1
        self._notify()

    async def sglang_pause(self, mode: str) -> None:
        """TM ``pause_generation``: pause (the gate closes); ``abort``:
        abort every request in flight (``abort_request(abort_all=True)``)
        and return once none is left; ``retract`` / ``in_place``: the
        scheduler stops (SCH ``pause_generation``), ``retract`` retracting
        its running requests."""
        self.paused, self.pause_mode = True, mode
        self.pauses[mode] += 1
        if mode == "abort":
            self.abort(self.runs(), "pause_generation")
            self._notify()
            await self._wait_until(lambda: not self._runs)
            return
        self.gpu.freeze()
        if mode == "retract":
            retracted = sum(self.gpu.retract(run.progress) for run in self.runs() if not run.abort)
            self.retractions += retracted
        self._notify()

    def sglang_continue(self) -> None:
        """TM ``continue_generation``: unpause (the gate opens, the scheduler runs)."""
        self.paused, self.pause_mode = False, None
        self.gpu.thaw()
        self._notify()

    def sglang_update_weight_version(self, new_version: str, abort_all: bool) -> None:
        """http_server ``update_weight_version``: abort everything first
        when asked (the default), then the label (scheduler and tokenizer)."""
        if abort_all:
            self.abort(self.runs(), "update_weight_version")
        self.set_version(new_version)
        self.reported_version = new_version
        self._notify()

    async def sglang_update_from_disk(
        self,
        model_path: str,
        load_format: str | None,
        abort_all: bool,
        weight_version: str | None,
        flush_cache: bool,
    ) -> tuple[bool, str]:
        """TM ``update_weights_from_disk``: abort everything when asked;
        unless paused, take the writer lock (new requests wait, the ones in
        flight finish first); load (the emulator loads nothing and always
        succeeds); record the version; flush the cache, which fails the call
        (the weights and label stay updated in the scheduler) while requests
        are running or queued (the queue ignored while the scheduler is
        paused); on success the tokenizer manager takes the model path, load
        format and version."""
        load_format = load_format or self.load_format
        if abort_all:
            self.abort(self.runs(), "update_weights_from_disk")
        writer = not self.paused
        if writer:
            self._writers += 1
            self._notify()
        try:
            if writer:
                await self._wait_until(lambda: not self._runs)
            success, message = True, "Succeeded to update model weights."
            if weight_version is not None:
                self.set_version(weight_version)
            if flush_cache:
                if self._idle():
                    self.flush()
                else:
                    success, message = False, FLUSH_REFUSED
        finally:
            if writer:
                self._writers -= 1
                self._notify()
        if success:
            self.model_path, self.load_format = model_path, load_format
            if weight_version is not None:
                self.reported_version = weight_version
                message += f" Weight version updated to {weight_version}."
        self._notify()
        return success, message

    def sglang_abort_request(self, rid: str, abort_all: bool) -> int:
        """TM ``abort_request``: everything with ``abort_all``; else, when a
        request with exactly this rid is known (in flight or held), the
        scheduler aborts every request whose rid starts with it (SCH
        ``abort_request``; held requests are not in the scheduler yet). An
        empty rid without ``abort_all`` is ignored."""
        if abort_all:
            return self.abort(self.runs(), "abort_request")
        if not rid or (rid not in self._runs and rid not in self._held):
            return 0
        return self.abort_keys([rid], "abort_request", prefix=True)

    # -- vLLM's RL routes ----------------------------------------------------------

    async def vllm_pause(self, mode: str, clear_cache: bool) -> None:
        """``EngineCoreProc.pause_generation``: ``abort`` aborts everything
        (``finish_requests``), ``abort``/``wait`` refuse new requests until
        resumed (PAUSED_NEW: the engine still steps, so ``wait`` lets the
        requests in flight finish and returns when none is left), ``keep``
        freezes the engine (PAUSED_ALL) and queues new requests. The caches
        are cleared once drained when ``clear_cache`` (ignored for ``keep``)."""
        self.paused, self.pause_mode = True, mode
        self.pauses[mode] += 1
        if mode == "keep":
            self.gpu.freeze()
            self._notify()
            return
        self.gpu.thaw()
        if mode == "abort":
            self.abort(self.runs(), "pause")
        self._notify()
        await self._wait_until(lambda: not self._runs)
        if clear_cache:
            self.flush()

    def vllm_resume(self) -> None:
        """``EngineCoreProc.resume_scheduler``: accept and run again."""
        self.paused, self.pause_mode = False, None
        self.gpu.thaw()
        self._notify()

    def vllm_update_weight_version(self, new_version: str) -> None:
        """``EngineCore.set_weight_version``: the label of the next outputs."""
        self.set_version(new_version)
        self.reported_version = new_version
