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

Decode progress is one shared clock counted in steps; it advances at
``1 / decode_s_per_token`` per second while no prefill runs. A request that
samples n tokens waits until the clock has moved n steps past the moment it
joined. Steps are continuous, not quantised (joining mid-step costs nothing),
which is exact enough at the step sizes the emulator is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import trio

from rollout_session.testing.prefix_cache import PrefixCache

__all__ = ["GpuModel"]

# Decode steps closer than this to a request's target count as reached: the
# clock is a float sum of elapsed/step and never lands exactly.
_STEP_EPSILON = 1e-9


class GpuModel:
    """GPU time of one emulator worker; `serve` charges one request's time."""

    def __init__(
        self,
        cache: PrefixCache,
        *,
        base_latency_s: float,
        prefill_s_per_token: float,
        decode_s_per_token: float,
        contention: bool,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.cache = cache
        self.base_latency_s = base_latency_s
        self.prefill_s_per_token = prefill_s_per_token
        self.decode_s_per_token = decode_s_per_token
        self.contention = contention
        self._on_change = on_change
        # Trio's locks are fair: waiters get the GPU in arrival order.
        self._prefill_lock = trio.Lock()
        self._changed = trio.Event()
        # Contention state; invariant: _steps and the busy totals are exact as
        # of _since, and every change of `prefilling` or `decoding` first
        # brings them up to date (`_advance`).
        self.prefill_waiting = 0  # requests queued for or in prefill
        self.prefilling = False
        self.decoding = 0  # requests in the decode batch
        self._steps = 0.0
        self._since: float | None = None
        self.prefill_busy_s = 0.0
        self.decode_busy_s = 0.0  # time with >= 1 request decoding and no prefill

    def stats(self) -> dict[str, Any]:
        self._advance()
        return {
            "contention": self.contention,
            "prefill_waiting": self.prefill_waiting,
            "decoding": self.decoding,
            "prefill_busy_s": self.prefill_busy_s,
            "decode_busy_s": self.decode_busy_s,
        }

    async def serve(
        self, prompt: Sequence[int], sampled: Sequence[int], session_id: str | None
    ) -> int:
        """Wait the request's GPU time and update the cache; returns its cached tokens."""
        if not self.contention:
            cached = self.cache.match(prompt)
            await trio.sleep(
                self.base_latency_s
                + self.prefill_s_per_token * (len(prompt) - cached)
                + self.decode_s_per_token * len(sampled)
            )
            self.cache.insert([*prompt, *sampled], session_id)
            return cached
        await trio.sleep(self.base_latency_s)
        cached = await self._prefill(prompt, session_id)
        await self._decode(len(sampled))
        self.cache.insert([*prompt, *sampled], session_id)
        return cached

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
        if self.decode_s_per_token > 0:
            self._steps += elapsed / self.decode_s_per_token

    def _set_prefilling(self, value: bool) -> None:
        self._advance()
        self.prefilling = value
        self._notify()

    async def _prefill(self, prompt: Sequence[int], session_id: str | None) -> int:
        self.prefill_waiting += 1
        self._notify()
        try:
            async with self._prefill_lock:
                cached = self.cache.match(prompt)
                seconds = self.prefill_s_per_token * (len(prompt) - cached)
                if seconds > 0:
                    self._set_prefilling(True)
                    try:
                        await trio.sleep(seconds)
                    finally:
                        self._set_prefilling(False)
                self.cache.insert(prompt, session_id)
                return cached
        finally:
            self.prefill_waiting -= 1
            self._notify()

    async def _decode(self, tokens: int) -> None:
        if tokens == 0 or self.decode_s_per_token == 0:
            return
        self._advance()
        self.decoding += 1
        self._notify()
        target = self._steps + tokens
        try:
            while True:
                self._advance()
                remaining = target - self._steps
                if remaining <= _STEP_EPSILON:
                    return
                changed = self._changed
                if self.prefilling:
                    await changed.wait()  # decode is stopped until the prefill ends
                else:
                    with trio.move_on_after(remaining * self.decode_s_per_token):
                        await changed.wait()  # a prefill may start and stop the clock
        finally:
            self._advance()
            self.decoding -= 1
            self._notify()
