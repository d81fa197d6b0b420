"""The emulator tests' shared fixtures: the text model over the bundled
tokenizer (loaded once) and `serve`, which starts emulators on free ports."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio
from transformers import AutoTokenizer

from rollout_session.emulator.app import start_emulator
from rollout_session.emulator.model.generation import TextModel
from rollout_session.emulator.tokenizer import bundled_tokenizer_path
from rollout_session.emulator.worker import Emulator, EmulatorConfig
from tests.loopback import TLS

Serve = Callable[..., Awaitable[tuple[httpx.AsyncClient, Emulator]]]


@pytest.fixture(scope="session")
def model() -> TextModel:
    return TextModel(AutoTokenizer.from_pretrained(bundled_tokenizer_path()))


@pytest.fixture
def tokenizer(model: TextModel) -> Any:
    return model.tokenizer


@pytest.fixture
async def serve(nursery: trio.Nursery, model: TextModel) -> AsyncIterator[Serve]:
    """Start emulators (config overrides as keywords); each gets its own client."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(**overrides: Any) -> tuple[httpx.AsyncClient, Emulator]:
            server, emulator = await start_emulator(
                nursery, EmulatorConfig(**overrides), model=model
            )
            stack.push_async_callback(server.aclose)
            client = httpx.AsyncClient(base_url=server.url, timeout=10.0, verify=TLS)
            await stack.enter_async_context(client)
            return client, emulator

        yield start
