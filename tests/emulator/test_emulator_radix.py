"""The emulator's SGLang 0.5.23 ``--enable-session-radix-cache`` over real sockets:
chat turns carry a top-level ``session_id``, the prefix cache evicts unreferenced
KV first, ``/close_session`` only dereferences (docs/emulator.md, "Session
radix cache")."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from rollout_session.emulator.prefix_cache import PrefixCache
from rollout_session.emulator.worker import Emulator
from tests.emulator.conftest import Serve

# 20 blocks of 16 tokens; a turn below is 95 prompt + 6 sampled tokens (6 blocks).
CAPACITY = 320
COMPLETION = 6


@pytest.fixture
def serve(serve: Serve) -> Serve:
    """conftest's `serve`, with this module's cache size and completion length."""

    async def start(**overrides: Any) -> tuple[httpx.AsyncClient, Emulator]:
        overrides.setdefault("cache_capacity_tokens", CAPACITY)
        overrides.setdefault("completion_tokens", COMPLETION)
        return await serve(**overrides)

    return start


def ids(start: int, n: int = 95) -> list[int]:
    return list(range(start, start + n))


async def chat(client: httpx.AsyncClient, prompt: list[int], session_id: str | None = None) -> Any:
    body: dict[str, Any] = {"input_ids": prompt, "max_tokens": 64, "return_meta_info": True}
    if session_id is not None:
        body["session_id"] = session_id
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def history(prompt: list[int], answer: Any) -> list[int]:
    """The prompt and what was sampled for it."""
    return [*prompt, *(e[1] for e in answer["choices"][0]["meta_info"]["output_token_logprobs"])]


def cached(answer: Any) -> int:
    value: int = answer["choices"][0]["meta_info"]["cached_tokens"]
    return value


async def agent_then_traffic(client: httpx.AsyncClient, session_id: str | None) -> list[int]:
    """An agent's turn, then anonymous traffic that fills the cache twice over;
    returns the agent's next prompt (its history plus a new message)."""
    answer = await chat(client, ids(1000), session_id)
    for k in range(6):
        await chat(client, ids(10_000 + 1000 * k))
    return [*history(ids(1000), answer), *ids(5000, 20)]


@pytest.mark.parametrize("radix", [False, True], ids=["plain-lru", "session-radix"])
async def test_an_idle_referenced_session_survives_traffic(serve: Serve, radix: bool) -> None:
    client, emulator = await serve(enable_session_radix_cache=radix)
    prompt = await agent_then_traffic(client, "agent")
    # 101 tokens of history: 6 full blocks cached only if they survived.
    assert cached(await chat(client, prompt, "agent")) == (96 if radix else 0)
    assert emulator.cache.used_tokens <= CAPACITY


async def test_eviction_takes_unreferenced_blocks_first(serve: Serve) -> None:
    client, emulator = await serve(enable_session_radix_cache=True)
    # Two agents, then one anonymous request: the anonymous one is the newest.
    agents = {}
    for n, sid in enumerate(("a", "b")):
        answer = await chat(client, ids(1000 * (n + 1)), sid)
        agents[sid] = history(ids(1000 * (n + 1)), answer)
    anonymous = ids(9000)
    await chat(client, anonymous)
    assert emulator.cache.used_tokens == 18 * 16
    # Two blocks more than fit: plain LRU would take agent a's (the oldest).
    await chat(client, ids(20_000, 95 - 64))  # 2 blocks (prompt + completion: 37 tokens)
    await chat(client, ids(30_000, 95 - 64))
    assert emulator.cache.refs(agents["a"]) == [1] * 6
    assert emulator.cache.refs(agents["b"]) == [1] * 6
    # 6 blocks with its completion, 5 in its prompt: it lost its 2 deepest.
    assert emulator.cache.refs(anonymous) == [0] * 4
    assert emulator.cache.used_tokens == CAPACITY


async def test_close_makes_blocks_evictable_first_not_freed(serve: Serve) -> None:
    client, emulator = await serve(enable_session_radix_cache=True)
    first = await chat(client, ids(1000), "a")
    history_a = history(ids(1000), first)
    await chat(client, ids(2000), "b")
    used = emulator.cache.used_tokens
    assert (await client.post("/close_session", json={"session_id": "a"})).status_code == 200
    # Nothing freed: the closed session's next prompt still hits.
    assert emulator.cache.used_tokens == used
    assert emulator.cache.refs(history_a) == [0] * 6
    # An anonymous request inserted after the close is newer than a's blocks
    # but still loses to b's (referenced); a's go first when room is needed.
    await chat(client, ids(3000))
    await chat(client, ids(4000))  # 6 + 6 + 6 + 6 = 24 blocks > 20: 4 must go
    assert emulator.cache.refs(history_a) == [0] * 2  # a lost its 4 deepest blocks
    assert emulator.cache.session_tokens("b") == 96
    # A late request of the closed id starts a new generation and references again.
    again = await chat(client, [*history_a, *ids(5000, 20)], "a")
    assert cached(again) == 32
    assert emulator.cache.session_tokens("a") > 0


async def test_flag_off_ignores_session_ids_and_unknown_close(serve: Serve) -> None:
    client, emulator = await serve()
    await chat(client, ids(1000), "a")
    assert emulator.cache.session_tokens("a") == 0
    assert set(emulator.cache.refs(ids(1000))) == {0}
    used = emulator.cache.used_tokens
    for sid in ("a", "never-opened"):
        response = await client.post("/close_session", json={"session_id": sid})
        assert response.status_code == 200 and response.content == b""
    assert emulator.cache.used_tokens == used
    assert cached(await chat(client, [*ids(1000), 7])) == 80


async def test_a_turn_in_flight_at_close_does_not_reference_again(serve: Serve) -> None:
    client, emulator = await serve(enable_session_radix_cache=True, base_latency_s=0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(chat, client, ids(1000), "a")
        await emulator.wait_until(lambda: emulator.inflight == 1)
        assert (await client.post("/close_session", json={"session_id": "a"})).status_code == 200
    # The close tombstoned the id: the late finish cached its KV, unreferenced.
    assert emulator.cache.refs(ids(1000)) == [0] * 5
    await chat(client, [*ids(1000), 7], "a")  # a new request: a new generation
    assert emulator.cache.refs(ids(1000)) == [1] * 5


def test_branches_hold_a_reference_each_and_eviction_recedes() -> None:
    cache = PrefixCache(16 * 8, 16, session_refs=True)
    trunk = ids(0, 32)
    cache.insert([*trunk, *ids(100, 32)], cache.session_ref("s"))
    cache.insert([*trunk, *ids(200, 32)], cache.session_ref("s"))  # a branch: both kept
    assert cache.refs(trunk) == [2, 2]
    assert cache.refs([*trunk, *ids(100, 32)]) == [2, 2, 1, 1]
    cache.insert([*trunk, *ids(200, 48)], cache.session_ref("s"))  # extends the branch
    assert cache.refs([*trunk, *ids(200, 48)]) == [2, 2, 1, 1, 1]
    cache.insert(ids(900, 32))  # 9 blocks > 8: an unreferenced block goes first
    assert cache.refs(ids(900, 32)) == [0]
    cache.insert(ids(800, 48), cache.session_ref("t"))  # 11 blocks: 3 go
    # The unreferenced block, then the least recently used referenced leaves:
    # the first branch, whose reference receded to the trunk.
    assert cache.refs(ids(900, 32)) == []
    assert cache.refs([*trunk, *ids(100, 32)]) == [2, 2]
    assert cache.refs([*trunk, *ids(200, 48)]) == [2, 2, 1, 1, 1]
    assert cache.refs(ids(800, 48)) == [1, 1, 1]
    cache.release_session("s")
    assert cache.refs([*trunk, *ids(200, 48)]) == [0] * 5
    assert cache.session_tokens("t") == 48
