"""Session servers and emulator workers for a trainer's asyncio code.

A trainer awaits its generator or agent loop under asyncio (SkyRL's
``asyncio.run(trainer.train())``; verl's agent-loop workers), so the
adapters' tests run their bodies under asyncio, as the trainer does. The
servers are trio programs (the suite's own fixtures build them:
`tests.conftest.spawn_worker`, `create_app`, `start_server`); `TrioThread`
runs them in a trio loop of their own on a thread, and the test reaches
that loop with `TrioThread.run` / `run_sync` (trio's ``from_thread``) to
build stacks, read the emulators, or wait on them.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import httpx
import trio

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig, TextModel, builtin_template
from rollout_session.http.serving import RunningServer, start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import Worker, spawn_worker
from tests.loopback import TLS

__all__ = ["TrainerStack", "TrioThread"]

T = TypeVar("T")


class TrioThread:
    """A trio loop on a daemon thread, with one nursery for what it hosts."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._servers: list[RunningServer] = []
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="trio-servers", daemon=True)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # told to the test by stop()
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await trio.sleep_forever()

    def __enter__(self) -> TrioThread:
        self._thread.start()
        if not self._ready.wait(timeout=60) or self._token is None:
            raise RuntimeError(f"the trio thread did not start: {self._failure!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.run(self._close)
        self._thread.join(timeout=60)
        if self._failure is not None:
            raise self._failure

    async def _close(self) -> None:
        # Gracefully, as the suite's stacks close: the app closes its
        # worker clients; then the workers go with the nursery.
        for server in self._servers:
            await server.aclose()
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` in the trio loop (from a thread that is not it)."""
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    @property
    def nursery(self) -> trio.Nursery:
        assert self._nursery is not None
        return self._nursery

    def keep(self, server: RunningServer) -> None:
        self._servers.append(server)


@dataclass
class TrainerStack:
    """Emulator workers as a trainer launches them, behind a session server
    that was started with the first of them."""

    thread: TrioThread
    workers: list[Worker]
    server: RunningServer

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def worker_urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @classmethod
    def start(
        cls,
        thread: TrioThread,
        text_model: TextModel,
        emulator: EmulatorConfig,
        *,
        template: str = "chatml",
        num_workers: int = 2,
        **settings: Any,
    ) -> TrainerStack:
        return thread.run(
            _start, cls, thread, text_model, emulator, template, num_workers, settings
        )

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A request to the session server from the test's thread."""
        with httpx.Client(base_url=self.url, timeout=30, verify=TLS) as client:
            return client.request(method, path, **kwargs)


async def _start(
    cls: type[TrainerStack],
    thread: TrioThread,
    text_model: TextModel,
    emulator: EmulatorConfig,
    template: str,
    num_workers: int,
    settings: dict[str, Any],
) -> TrainerStack:
    template_text = builtin_template(template)
    workers = [
        await spawn_worker(
            thread.nursery,
            text_model,
            replace(emulator, chat_template=template_text, seed=emulator.seed + i),
            parsers=False,
        )
        for i in range(num_workers)
    ]
    tokenizer = ChatTokenizer(text_model.tokenizer, template_text)
    app_settings = Settings(workers=(workers[0].url,), port=0, **settings)
    app = create_app(app_settings, tokenizer=tokenizer, worker_tls=TLS)
    server = await start_server(thread.nursery, app, max_connections=app_settings.max_connections)
    thread.keep(server)
    return cls(thread, workers, server)
