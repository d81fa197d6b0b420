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

The costs are read from the emulator's config on every request (tests swap
``Emulator.config`` to change latency mid-test).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import trio

from rollout_session.testing.prefix_cache import PrefixCache, SessionRef

__all__ = ["GpuCosts", "GpuModel"]

# Decode time closer than this to a request's target counts as reached: the
# clock is a float sum of elapsed times and never lands exactly.
_EPSILON_S = 1e-9


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


class GpuModel:
    """GPU time of one emulator worker; `serve` charges one request's time."""

    def __init__(self, cache: PrefixCache, on_change: Callable[[], None] = lambda: None) -> None:
        self.cache = cache
        self._on_change = on_change
        # Trio's locks are fair: waiters get the GPU in arrival order.
        self._prefill_lock = trio.Lock()
        self._changed = trio.Event()
        # Contention state; invariant: _decoded_s and the busy totals are exact
        # as of _since, and every change of `prefilling` or `decoding` first
        # brings them up to date (`_advance`).
        self.prefill_waiting = 0  # requests queued for or in prefill
        self.prefilling = False
        self.decoding = 0  # requests in the decode batch
        self._decoded_s = 0.0  # the decode clock: time with no prefill running
        self._since: float | None = None
        self.prefill_busy_s = 0.0
        self.decode_busy_s = 0.0  # time with >= 1 request decoding and no prefill

    def stats(self) -> dict[str, Any]:
        self._advance()
        return {
            "prefill_waiting": self.prefill_waiting,
            "decoding": self.decoding,
            "prefill_busy_s": self.prefill_busy_s,
            "decode_busy_s": self.decode_busy_s,
        }

    async def serve(
        self,
        costs: GpuCosts,
        prompt: Sequence[int],
        sampled: Sequence[int],
        session: SessionRef | None,
        *,
        held: int | None = None,
        fill: Literal["all", "prompt", "none"] = "all",
    ) -> int:
        """Wait the request's GPU time and update the cache; returns its cached tokens.

        ``held``: the prefix a streaming session's slot holds (served from it,
        the cache is not looked up). ``fill``: what the cache keeps afterwards
        (a streaming turn publishes at most its first prompt; its KV stays in
        the slot). ``session``: the session reference the request took on
        arrival, registered when it finishes (not when its prefill is published).
        """
        if not costs.gpu_contention:
            cached = self.cache.match(prompt) if held is None else held
            await trio.sleep(
                costs.base_latency_s
                + costs.prefill_s_per_token * (len(prompt) - cached)
                + costs.decode_s_per_token * len(sampled)
            )
            self._fill(prompt, sampled, session, fill)
            return cached
        await trio.sleep(costs.base_latency_s)
        cached = await self._prefill(prompt, costs.prefill_s_per_token, held, fill != "none")
        await self._decode(costs.decode_s_per_token * len(sampled))
        self._fill(prompt, sampled, session, fill)
        return cached

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
    ) -> int:
        self.prefill_waiting += 1
        self._notify()
        try:
            async with self._prefill_lock:
                cached = self.cache.match(prompt) if held is None else held
                seconds = s_per_token * (len(prompt) - cached)
                if seconds > 0:
                    self._set_prefilling(True)
                    try:
                        await trio.sleep(seconds)
                    finally:
                        self._set_prefilling(False)
                if publish:
                    self.cache.insert(prompt)
                return cached
        finally:
            self.prefill_waiting -= 1
            self._notify()

    async def _decode(self, seconds: float) -> None:
        """Wait until the decode clock has run ``seconds`` (steps x step time)."""
        if seconds <= 0:
            return
        self._advance()
        self.decoding += 1
        self._notify()
        target = self._decoded_s + seconds
        try:
            while True:
                self._advance()
                remaining = target - self._decoded_s
                if remaining <= _EPSILON_S:
                    return
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
