"""The pool's unit tests: a bare HTTP/1.1 worker on loopback (`origin.Origin`)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import pytest
import trio

from tests.unit.engines.pool.origin import Origin


@pytest.fixture
async def origin(nursery: trio.Nursery) -> AsyncIterator[Origin]:
    server = Origin()
    serve = functools.partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1")
    listeners = await nursery.start(serve)
    server.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    yield server
