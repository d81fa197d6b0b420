"""Fixtures of the end-to-end tests (tests/conftest.py holds the stacks)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

import pytest

_SDK = TypeVar("_SDK")

# The async SDK clients (openai, anthropic) the running test opened.
_opened: list[Any] = []


def closed_after_test(client: _SDK) -> _SDK:
    """An async SDK client, closed when the test that opened it ends: a module
    whose tests open them uses `close_sdk_clients` (``pytestmark``)."""
    _opened.append(client)
    return client


# Not autouse: a trio fixture cannot serve the synchronous tests here.
@pytest.fixture
async def close_sdk_clients() -> AsyncIterator[None]:
    yield
    while _opened:
        await _opened.pop().close()
