"""The emulator's model of a worker's GPU time, with opt-in contention.

Without contention (the default) every request sleeps its own
``base + prefill × uncached + decode × sampled`` whatever else the worker is
doing: an infinitely parallel GPU. The prefix cache is looked up on arrival
and filled when the answer is ready.

With contention (``EmulatorConfig.gpu_contention``) the worker has one GPU,
run the way SGLang's scheduler runs it by default (prefill first, no mixed
prefill/decode batches):

- prefill is compute-bound, so requests are prefilled one at a time in
  arrival order (a FIFO lock) at ``prefill_s_per_token`` per uncached prompt
  token. The cache lookup happens when a request's prefill *starts* (SGLang
  matches the radix tree when it schedules the prefill batch) and the prompt
  is cached as soon as its prefill ends, so a queued request reuses a prefix
  that a request ahead of it just prefilled;
- decode is batched and memory-bound: one step of ``decode_s_per_token``
  advances every decoding request by one token, whatever the batch size, so
  concurrent decodes overlap;
- while a prefill runs, decode steps stop (prefill has priority): a long
  uncached prompt delays every request decoding on the same worker. That is
  the contention the default model leaves out;
- ``base_latency_s`` (HTTP, tokenisation, scheduling) stays outside the GPU
  and overlaps freely.

Decode progress is one shared clock: the seconds during which no prefill
ran. A request that samples n tokens waits until that clock has moved
n x ``decode_s_per_token`` past the moment it joined. Steps are continuous,
not quantised (joining mid-step costs nothing), which is exact enough at the
step sizes the emulator is given.

In both models the worker can be frozen (`GpuModel.freeze`, a paused
scheduler: SGLang's ``/pause_generation`` in ``retract`` or ``in_place``
mode, vLLM's ``/pause?mode=keep``): no time passes for any request, in any
phase, until `GpuModel.thaw`. Each request's `Progress` says where it is
(queued in its base latency, prefilling, decoding, done) and how many tokens
it has decoded (`GpuModel.decoded`): the tokens whose decode time has
elapsed, what an abort keeps and what a weight-version change splits. A
frozen request can be retracted (`GpuModel.retract`, SGLang's ``retract``
mode): after the thaw it prefills its prompt and the tokens it had decoded
again (looked up in the cache like any prefill) and decodes the rest.

The costs are read from the emulator's config on every request (tests swap
``Emulator.config`` to change latency mid-test).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import trio

from rollout_session.emulator.prefix_cache import PrefixCache, SessionRef

__all__ = ["GpuCosts", "GpuModel", "Progress"]

# Decode time closer than this to a request's target counts as reached: the
# clock is a float sum of elapsed times and never lands exactly.
_EPSILON_S = 1e-9
# A token whose decode time is within this fraction of a step of elapsing has.
_EPSILON_STEPS = 1e-6

Phase = Literal["queued", "prefill", "decode", "done"]


class GpuCosts(Protocol):
    """The `EmulatorConfig` fields the model reads (seconds)."""

    @property
    def base_latency_s(self) -> float: ...
    @property
    def prefill_s_per_token(self) -> float: ...
    @property
    def decode_s_per_token(self) -> float: ...
    @property
    def gpu_contention(self) -> bool: ...


@dataclass(eq=False, slots=True)
class Progress:
    """Where one request is on the GPU (`GpuModel.serve` keeps it current).

    ``queued``: in its base latency or (with contention) waiting for the
    GPU to prefill it (SGLang: the waiting queue), or retracted back to
    it; ``prefill``; ``decode``; ``done``. `GpuModel.decoded` reads the
    tokens decoded so far.
    """

    phase: Phase = "queued"
    total: int = 0  # tokens the request decodes
    decoded: int = 0  # tokens decoded before the current decode stretch
    step_s: float = 0.0  # decode time per token of the current stretch
    since: float = 0.0  # the decode clock when the current stretch began
    contention: bool = False  # which decode clock the stretch runs on
    cached: int = 0  # prompt tokens served from KV, over every prefill
    prefills: int = 0  # prefills started (1 + re-prefills after retractions)
    retractions: int = 0
    retracted: bool = False  # prefill again before decoding on (set by `retract`)


class GpuModel:
    """GPU time of one emulator worker; `serve` charges one request's time."""

    def __init__(self, cache: PrefixCache, on_change: Callable[[], None] = lambda: None) -> None:
        self.cache = cache
        self._on_change = on_change
        # Trio's locks are fair: waiters get the GPU in arrival order.
        self._prefill_lock = trio.Lock()
        self._changed = trio.Event()
        # Contention state; invariant: _decoded_s and the busy totals are exact
        # as of _since, and every change of `prefilling`, `decoding` or
        # `frozen` first brings them up to date (`_advance`).
        self.prefill_waiting = 0  # requests queued for or in prefill
        self.prefilling = False
        self.decoding = 0  # requests in the decode batch
        self._decoded_s = 0.0  # the decode clock: unfrozen time with no prefill running
        self._since: float | None = None
        self.prefill_busy_s = 0.0
        self.decode_busy_s = 0.0  # time with >= 1 request decoding and no prefill
        # Freezing (both models): the running clock is the time the worker
        # was not frozen; waiters without contention wake only on a freeze
        # or a thaw (`_frozen_changed`), never on the contention events.
        self.frozen = False
        self._run_s = 0.0
        self._run_since: float | None = None  # set on first use (inside trio)
        self._frozen_changed = trio.Event()

    def stats(self) -> dict[str, Any]:
        self._advance()
        return {
            "prefill_waiting": self.prefill_waiting,
            "decoding": self.decoding,
            "prefill_busy_s": self.prefill_busy_s,
            "decode_busy_s": self.decode_busy_s,
            "frozen": self.frozen,
        }

    # -- freezing -------------------------------------------------------------

    def _running_now(self) -> float:
        """Seconds the worker has run (not frozen) so far."""
        if self.frozen:
            return self._run_s
        now = trio.current_time()
        if self._run_since is None:
            self._run_since = now
        return self._run_s + now - self._run_since

    def freeze(self) -> None:
        """Stop every request's clock (a paused scheduler)."""
        if self.frozen:
            return
        self._advance()
        self._run_s = self._running_now()
        self.frozen = True
        self._freeze_changed()

    def thaw(self) -> None:
        """Let time pass again; retracted requests prefill again first."""
        if not self.frozen:
            return
        self._advance()
        self._run_since = trio.current_time()
        self.frozen = False
        self._freeze_changed()

    def _freeze_changed(self) -> None:
        self._frozen_changed.set()
        self._frozen_changed = trio.Event()
        self._notify()

    def retract(self, progress: Progress) -> bool:
        """SGLang's ``retract_all`` on a frozen worker: a prefilling or
        decoding request keeps the tokens it decoded, goes back to the queue
        (phase ``queued``) and, once thawed, prefills its prompt and those
        tokens again before decoding the rest. False: nothing to retract."""
        if not self.frozen:
            raise RuntimeError("only a frozen worker retracts its requests")
        if progress.phase not in ("prefill", "decode"):
            return False
        progress.decoded = self.decoded(progress)
        progress.phase = "queued"
        progress.retracted = True
        progress.retractions += 1
        self._on_change()
        return True

    def decoded(self, progress: Progress) -> int:
        """Tokens `progress`'s request has decoded now: those whose decode
        time has elapsed (all of them once done)."""
        if progress.phase == "done":
            return progress.total
        if progress.phase != "decode":
            return progress.decoded
        if progress.step_s <= 0:
            return progress.total
        elapsed = self._decode_clock(progress.contention) - progress.since
        steps = math.floor(elapsed / progress.step_s + _EPSILON_STEPS)
        return min(progress.total, progress.decoded + max(0, steps))

    def _decode_clock(self, contention: bool) -> float:
        if not contention:
            return self._running_now()
        self._advance()
        return self._decoded_s

    async def _run_for(self, seconds: float, progress: Progress | None = None) -> bool:
        """Wait until the worker has run (unfrozen) for ``seconds``; False
        when ``progress`` was retracted meanwhile (returned after the thaw)."""
        left = seconds
        while True:
            if self.frozen:
                await self._frozen_changed.wait()
                if progress is not None and progress.retracted:
                    return False
                continue
            if left <= _EPSILON_S:
                return True
            start = self._running_now()
            changed = self._frozen_changed
            with trio.move_on_after(left):
                await changed.wait()
            left -= self._running_now() - start

    # -- serving --------------------------------------------------------------

    async def serve(
        self,
        costs: GpuCosts,
        prompt: Sequence[int],
        sampled: Sequence[int],
        session: SessionRef | None,
        *,
        held: int | None = None,
        fill: Literal["all", "prompt", "none"] = "all",
        progress: Progress | None = None,
        reuse: int | None = None,
    ) -> int:
        """Wait the request's GPU time and update the cache; returns its cached tokens.

        ``held``: the prefix a streaming session's slot holds (served from it,
        the cache is not looked up). ``fill``: what the cache keeps afterwards
        (a streaming turn publishes at most its first prompt; its KV stays in
        the slot). ``session``: the session reference the request took on
        arrival, registered when it finishes (not when its prefill is published).
        ``progress``: where the request is, for aborts, retractions and
        version changes (kept current; one is made when not given).
        ``reuse``: at most this many prompt tokens are served from the cache
        (SGLang's ``logprob_start_len`` with ``return_logprob``; 0: vLLM's
        ``skip_reading_prefix_cache`` for prompt logprobs).
        """
        p = progress if progress is not None else Progress()
        p.total = len(sampled)
        contention = costs.gpu_contention
        p.contention = contention
        # Without contention the cache is looked up on arrival.
        arrival_cached = None
        if not contention:
            arrival_cached = self._match(prompt, reuse) if held is None else held
        await trio.lowlevel.checkpoint()
        await self._run_for(costs.base_latency_s)
        context: Sequence[int] = prompt
        lookup = held
        while True:
            p.retracted = False
            p.prefills += 1
            if contention:  # queued for the GPU until its prefill starts
                p.phase = "queued"
            else:
                p.phase = "prefill"
                self._on_change()
            if contention:
                cached = await self._prefill(
                    context, costs.prefill_s_per_token, lookup, fill != "none", p, reuse
                )
                if cached is None:  # retracted mid-prefill: queue for it again
                    continue
            else:
                cached = arrival_cached if p.prefills == 1 else self._match(context, reuse)
                assert cached is not None
                seconds = costs.prefill_s_per_token * (len(context) - cached)
                if not await self._run_for(seconds, p):
                    continue
            p.cached += cached
            if await self._decode(costs.decode_s_per_token, p):
                break
            # Retracted: its KV is gone; it prefills what it had again.
            context, lookup = [*prompt, *sampled[: p.decoded]], None
        p.phase = "done"
        self._on_change()
        self._fill(prompt, sampled, session, fill)
        return p.cached

    def _match(self, prompt: Sequence[int], reuse: int | None) -> int:
        cached = self.cache.match(prompt)
        return cached if reuse is None else min(cached, reuse)

    def _fill(
        self,
        prompt: Sequence[int],
        sampled: Sequence[int],
        session: SessionRef | None,
        fill: Literal["all", "prompt", "none"],
    ) -> None:
        if fill == "all":
            self.cache.insert([*prompt, *sampled], session)
        elif fill == "prompt":
            self.cache.insert(prompt, session)

    # -- contention ----------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        self._on_change()

    def _advance(self) -> None:
        """Bring the decode clock and the busy totals up to now."""
        now = trio.current_time()
        elapsed = 0.0 if self._since is None else now - self._since
        self._since = now
        if self.frozen:
            return
        if self.prefilling:
            self.prefill_busy_s += elapsed
            return
        if self.decoding:
            self.decode_busy_s += elapsed
        self._decoded_s += elapsed

    def _set_prefilling(self, value: bool) -> None:
        self._advance()
        self.prefilling = value
        self._notify()

    async def _prefill(
        self,
        prompt: Sequence[int],
        s_per_token: float,
        held: int | None,
        publish: bool,
        progress: Progress,
        reuse: int | None,
    ) -> int | None:
        """One prefill on the GPU (FIFO); None when it was retracted midway."""
        self.prefill_waiting += 1
        self._notify()
        try:
            async with self._prefill_lock:
                progress.phase = "prefill"
                self._on_change()
                cached = self._match(prompt, reuse) if held is None else held
                seconds = s_per_token * (len(prompt) - cached)
                if seconds > 0:
                    self._set_prefilling(True)
                    try:
                        finished = await self._run_for(seconds, progress)
                    finally:
                        self._set_prefilling(False)
                    if not finished:
                        return None
                elif self.frozen and not await self._run_for(0.0, progress):
                    return None
                if publish:
                    self.cache.insert(prompt)
                return cached
        finally:
            self.prefill_waiting -= 1
            self._notify()

    async def _decode(self, step_s: float, progress: Progress) -> bool:
        """Decode the rest of ``progress``'s tokens: each takes ``step_s`` of
        the decode clock (without contention: of unfrozen time; with it:
        of unfrozen time with no prefill running). False when retracted
        meanwhile (returned after the thaw)."""
        p = progress
        contention = p.contention
        p.step_s = step_s
        p.since = self._decode_clock(contention)
        p.phase = "decode"
        self._on_change()
        seconds = step_s * (p.total - p.decoded)
        if seconds <= 0:
            if self.frozen and not await self._run_for(0.0, p):
                return False
            p.decoded = p.total
            return True
        if not contention:
            if not await self._run_for(seconds, p):
                return False
            p.decoded = p.total
            return True
        self._advance()
        self.decoding += 1
        self._notify()
        target = p.since + seconds
        try:
            while True:
                if self.frozen:
                    await self._frozen_changed.wait()
                    if p.retracted:
                        return False
                    continue
                self._advance()
                remaining = target - self._decoded_s
                if remaining <= _EPSILON_S:
                    p.decoded = p.total
                    return True
                changed = self._changed
                if self.prefilling:
                    await changed.wait()  # decode is stopped until the prefill ends
                else:
                    with trio.move_on_after(remaining):
                        await changed.wait()  # a prefill may start and stop the clock
        finally:
            self._advance()
            self.decoding -= 1
            self._notify()
