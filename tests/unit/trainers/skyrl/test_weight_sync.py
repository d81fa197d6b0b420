"""SkyRL's weight sync wrapped so that it pauses the session servers of the
generator built on its inference client
(rollout_session/trainers/skyrl/weight_sync.py). A dispatch of SkyRL's
shape stands in here; SkyRL's own runs in tests/trainers/skyrl."""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from rollout_session.trainers.skyrl.weight_sync import _wrap, register, registered


class Client:
    """SkyRL's inference client as the hook reads it: a sync count."""

    def __init__(self) -> None:
        self.weight_version = 0


class Dispatch:
    """``save_weights_for_sampler`` as SkyRL's: the sync, then the count."""

    def __init__(self, client: Client) -> None:
        self._inference_engine_client = client
        self.calls: list[str | None] = []

    async def save_weights_for_sampler(self, model_id: str | None = None) -> str:
        self.calls.append(model_id)
        self._inference_engine_client.weight_version += 1
        return "synced"


class Sync:
    """`trainers.weight_sync.WeightSync`'s ``around``, recorded."""

    def __init__(self) -> None:
        self.steps: list[int | None] = []

    async def around(
        self, step: Callable[[], int | None], update: Callable[[], Awaitable[Any]]
    ) -> Any:
        result = await update()
        self.steps.append(step())  # asked once the update is done
        return result


class Wrapped(Dispatch):
    pass


_wrap(Wrapped, lambda dispatch: dispatch._inference_engine_client)


async def test_a_sync_through_a_registered_client_goes_around_the_session_servers() -> None:
    client, other = Client(), Client()
    sync = Sync()
    register(client, sync)  # type: ignore[arg-type]
    try:
        dispatch = Wrapped(client)
        assert await dispatch.save_weights_for_sampler("lora-a") == "synced"
        assert await dispatch.save_weights_for_sampler() == "synced"
        # The session servers resumed at the count after each sync.
        assert sync.steps == [1, 2]
        assert dispatch.calls == ["lora-a", None]
        # Another client's syncs pause nothing.
        await Wrapped(other).save_weights_for_sampler()
        assert sync.steps == [1, 2]
    finally:
        register(client, None)
    await dispatch.save_weights_for_sampler()
    assert sync.steps == [1, 2]


def test_wrapped_once() -> None:
    first = Wrapped.save_weights_for_sampler
    _wrap(Wrapped, lambda dispatch: dispatch._inference_engine_client)
    assert Wrapped.save_weights_for_sampler is first
    assert first._rollout_session_inner is Dispatch.save_weights_for_sampler  # type: ignore[attr-defined]


def test_a_client_gone_is_unregistered() -> None:
    client = Client()
    register(client, Sync())  # type: ignore[arg-type]
    assert registered(client) is not None
    del client
    gc.collect()
    # A new object may reuse the id; it is not the client registered.
    assert all(registered(Client()) is None for _ in range(100))


@pytest.mark.parametrize("version", [None, "3"], ids=["none", "str"])
async def test_a_client_without_a_count_resumes_unnamed(version: Any) -> None:
    client = Client()
    client.weight_version = version
    sync = Sync()

    class Counting(Dispatch):
        async def save_weights_for_sampler(self, model_id: str | None = None) -> str:
            return "synced"

    _wrap(Counting, lambda dispatch: dispatch._inference_engine_client)
    register(client, sync)  # type: ignore[arg-type]
    try:
        await Counting(client).save_weights_for_sampler()
    finally:
        register(client, None)
    assert sync.steps == [None]
