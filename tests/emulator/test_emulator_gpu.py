"""The emulator's GPU-time model (`rollout_session.emulator.gpu`), on trio's virtual clock.

Every test runs under the autojump clock, so times are exact virtual seconds:
no sleeps, no wall-clock asserts. Requests are started one at a time with
`wait_all_tasks_blocked` in between, which fixes their arrival order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import trio
import trio.testing

from rollout_session.emulator.gpu import GpuModel
from rollout_session.emulator.prefix_cache import PrefixCache


@dataclass(frozen=True)
class Costs:
    """The `EmulatorConfig` fields `GpuModel` reads."""

    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0
    base_latency_s: float = 0.0
    gpu_contention: bool = True


def gpu() -> GpuModel:
    return GpuModel(PrefixCache(1 << 20))


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


async def run(
    model: GpuModel, costs: Costs, requests: Sequence[tuple[float, list[int], int]]
) -> list[tuple[float, int]]:
    """Serve (arrival s, prompt, sampled tokens) requests; (finish s, cached) each."""
    t0 = trio.current_time()
    done: list[tuple[float, int]] = [(0.0, 0)] * len(requests)

    async def one(i: int, ids: list[int], sampled: int) -> None:
        cached = await model.serve(costs, ids, [1] * sampled, None)
        done[i] = (round(trio.current_time() - t0, 6), cached)

    async with trio.open_nursery() as nursery:
        for i, (arrival, ids, sampled) in enumerate(requests):
            await trio.sleep_until(t0 + arrival)
            nursery.start_soon(one, i, ids, sampled)
            await trio.testing.wait_all_tasks_blocked()
    return done


@pytest.mark.parametrize("contention", [False, True])
async def test_a_lone_request_costs_the_same_in_both_models(
    autojump_clock: trio.testing.MockClock, contention: bool
) -> None:
    costs = Costs(0.001, 0.01, base_latency_s=0.1, gpu_contention=contention)
    assert await run(gpu(), costs, [(0, prompt(1000), 50)]) == [(0.1 + 1.0 + 0.5, 0)]


async def test_without_contention_requests_overlap_completely(
    autojump_clock: trio.testing.MockClock,
) -> None:
    costs = Costs(0.001, 0.01, gpu_contention=False)
    requests = [(0, prompt(1000, 10_000 * i), 100) for i in range(3)]
    assert await run(gpu(), costs, requests) == [(2.0, 0)] * 3


async def test_prefill_is_serialised_in_arrival_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = gpu()
    requests = [(0.1 * i, prompt(1000, 10_000 * i), 0) for i in range(3)]
    # The base latency overlaps; the three 1 s prefills queue on the one GPU.
    assert await run(model, Costs(0.001, base_latency_s=0.5), requests) == [
        (1.5, 0),
        (2.5, 0),
        (3.5, 0),
    ]
    assert model.prefill_busy_s == pytest.approx(3.0)
    assert model.prefill_waiting == 0 and not model.prefilling


async def test_decode_is_batched(autojump_clock: trio.testing.MockClock) -> None:
    model = gpu()
    requests = [(0, prompt(10), 100), (0.25, prompt(10, 100), 100)]
    # 100 steps of 10 ms each; the second joins the batch 25 steps later.
    assert await run(model, Costs(decode_s_per_token=0.01), requests) == [(1.0, 0), (1.25, 0)]
    assert model.decode_busy_s == pytest.approx(1.25)


async def test_a_prefill_stalls_every_decoding_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = gpu()
    requests = [
        (0, [7], 100),  # prefill of 1 ms, then 100 decode steps
        (0.501, prompt(1000, 100), 10),  # a 1 s prefill arrives mid-decode
    ]
    # The first request is 50 steps in when decode stops for 1 s: it ends 1 s
    # late. The second decodes its 10 steps alongside it.
    assert await run(model, Costs(0.001, 0.01), requests) == [(2.001, 0), (1.601, 0)]
    assert model.prefill_busy_s == pytest.approx(1.001)
    assert model.decode_busy_s == pytest.approx(1.0)


async def test_a_queued_request_reuses_the_prefix_prefilled_ahead_of_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared = prompt(960)
    requests = [(0, [*shared, *prompt(40, 5000)], 0), (0, [*shared, *prompt(40, 6000)], 0)]
    # Looked up when its prefill starts, the second prompt finds the shared
    # 960 tokens the first one just cached, and prefills only its own 40.
    assert await run(gpu(), Costs(0.001), requests) == [(1.0, 0), (1.04, 960)]
    # Without contention both look up on arrival: neither is cached yet.
    independent = Costs(0.001, gpu_contention=False)
    assert await run(gpu(), independent, requests) == [(1.0, 0), (1.0, 0)]


async def test_a_cancelled_prefill_frees_the_gpu(autojump_clock: trio.testing.MockClock) -> None:
    model, costs = gpu(), Costs(0.001)
    t0 = trio.current_time()
    finished: list[float] = []

    async def gives_up() -> None:
        with trio.move_on_after(0.5):  # the client goes away mid-prefill
            await model.serve(costs, prompt(1000), [], None)

    async def queued() -> None:
        await model.serve(costs, prompt(500, 5000), [], None)
        finished.append(trio.current_time() - t0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(gives_up)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(queued)
    assert finished == [pytest.approx(1.0)]  # started at 0.5 s instead of 1 s
    assert model.prefill_busy_s == pytest.approx(1.0)
    assert model.prefill_waiting == 0 and not model.prefilling
    assert model.cache.match(prompt(1000)) == 0  # an unfinished prefill caches nothing
