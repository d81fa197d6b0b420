"""A fleet of session servers as Ray actors (docs/deploy.md#ray); the ``ray`` extra.

A trainer already on Ray adds one call::

    from rollout_session.fleet.ray import start_fleet

    fleet = start_fleet(num_servers=4, workers=engine_urls, tokenizer="/models/Qwen3-8B")
    async with fleet.client() as client:   # a SessionClient over fleet.urls
        handle = await client.create()      # give the agent handle.base_url
    fleet.shutdown()

Each actor is one shard (`http/fleet.py`): a plain session server run on a thread
of the actor's process. It binds a free port first; once every actor has
one, each is told the fleet's URLs and starts serving, so a shard knows the
whole fleet before it takes its first request. With ``demo=True`` one more
actor runs the emulator workers every shard shares (no GPU).

Nothing restarts a dead actor: a restarted one would listen on another
port, and its sessions hash to the old URL. Start a new fleet instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import trio

from ..cli.demo import start_demo_workers
from ..cli.run import run_server
from ..client import SessionClient
from ..config import Settings
from .processes import bind_sockets, fleet_urls

__all__ = ["RayFleet", "start_fleet"]

# A server that does not stop gracefully within this is killed with its actor.
_STOP_TIMEOUT_S = 60.0


class _Loop:
    """A trio event loop on its own thread, running `main` until `stop`."""

    def __init__(self) -> None:
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def start(self, main: Any, *args: Any) -> Any:
        """Run ``main(*args, until, task_status=…)`` on the thread; return
        what it passed to `task_status.started` (or raise its error)."""

        async def run() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            try:
                async with trio.open_nursery() as nursery:
                    self._result = await nursery.start(main, *args, self._stop.wait)
                    self._started.set()
            except BaseException as exc:
                self._error = exc
                raise
            finally:
                self._started.set()

        def thread() -> None:
            with contextlib.suppress(BaseException):  # `start` reports it
                trio.run(run)

        self._thread = threading.Thread(target=thread, name="rollout-session", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise RuntimeError(f"cannot start: {self._error!r}") from self._error
        return self._result

    def stop(self, timeout_s: float) -> bool:
        """Ask `main` to stop and wait for it; False if it did not in time."""
        if self._token is None or self._thread is None:
            return True
        stop = self._stop
        assert stop is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(stop.set)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


async def _serve_shard(
    settings: Settings,
    listen_fd: int,
    until: Any,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    await run_server(settings, until, listen_fd=listen_fd, task_status=task_status)


async def _serve_demo(
    settings: Settings, until: Any, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
) -> None:
    async with trio.open_nursery() as nursery:
        started = await start_demo_workers(nursery, settings)
        task_status.started((started.workers, started.tokenizer))
        await until()
        nursery.cancel_scope.cancel()


@ray.remote
class _ShardActor:
    """One shard: `bind` a port, then `start` serving as `fleet[shard]`."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._loop = _Loop()

    def bind(self, host: str | None) -> str:
        sock = bind_sockets(host or "0.0.0.0", 0, 1)[0]
        advertised = host or ray.util.get_node_ip_address()
        url = fleet_urls(advertised, [sock])[0]
        self._fd = sock.detach()  # the server takes it over
        return url

    def start(self, settings: dict[str, Any], fleet: tuple[str, ...], shard: int) -> str:
        assert self._fd is not None, "bind first"
        journal = settings["journal"]
        if journal is not None:  # one journal per shard, as under --processes
            journal = str(Path(journal) / f"shard-{shard}")
        own = Settings(**{**settings, "journal": journal}, fleet=fleet, shard=shard)
        url: str = self._loop.start(_serve_shard, own, self._fd)
        return url

    def stop(self) -> bool:
        return self._loop.stop(_STOP_TIMEOUT_S)


@ray.remote
class _DemoActor:
    """The emulator workers of a demo fleet."""

    def __init__(self) -> None:
        self._loop = _Loop()

    def start(self, settings: dict[str, Any]) -> tuple[tuple[str, ...], str]:
        workers, tokenizer = self._loop.start(_serve_demo, Settings(**settings))
        return tuple(workers), str(tokenizer)

    def stop(self) -> bool:
        return self._loop.stop(_STOP_TIMEOUT_S)


@dataclass
class RayFleet:
    """A running fleet: its shards' URLs, a client over them, its shutdown."""

    urls: tuple[str, ...]
    api_key: str | None
    _actors: list[Any] = field(repr=False)
    _demo: Any = field(default=None, repr=False)

    def client(self, **kwargs: Any) -> SessionClient:
        """A `SessionClient` over `urls` (with the fleet's key, unless given)."""
        kwargs.setdefault("api_key", self.api_key)
        return SessionClient(self.urls, **kwargs)

    def shutdown(self) -> None:
        """Stop every shard gracefully (in-flight turns get their grace),
        then the demo workers, then the actors and their processes."""
        ray.get([actor.stop.remote() for actor in self._actors])
        if self._demo is not None:
            ray.get(self._demo.stop.remote())
        for actor in [*self._actors, *([self._demo] if self._demo is not None else [])]:
            ray.kill(actor)
        self._actors = []
        self._demo = None


def _settings_dict(settings: Settings) -> dict[str, Any]:
    """`settings` as keyword arguments that pickle (Ray sends them)."""
    out = {f.name: getattr(settings, f.name) for f in dataclasses.fields(Settings)}
    out["chat_template_kwargs"] = dict(settings.chat_template_kwargs)
    for name in ("fleet", "shard"):
        del out[name]
    return out


def start_fleet(
    num_servers: int,
    workers: Sequence[str] = (),
    demo: bool = False,
    *,
    host: str | None = None,
    per_node: bool = False,
    actor_options: Mapping[str, Any] | None = None,
    **settings: Any,
) -> RayFleet:
    """Start `num_servers` shards as Ray actors (on each alive node if
    `per_node`), serving `workers` (or, with `demo`, emulator workers
    started in one more actor); `settings` are `Settings` fields. `host`:
    the address to listen on and advertise (default: every address, the
    node's IP advertised). `actor_options` go to each shard actor's
    ``.options`` (default ``num_cpus=1``: a shard keeps about one core busy
    under load), e.g. a scheduling strategy to co-locate with engines."""
    if num_servers < 1:
        raise ValueError("num_servers must be >= 1")
    base = Settings(workers=tuple(workers), demo=demo, **settings)  # checked here, once
    options = {"num_cpus": 1, **(actor_options or {})}
    demo_actor = None
    if demo:
        demo_actor = _DemoActor.options(num_cpus=0).remote()  # type: ignore[attr-defined]
        urls, tokenizer = ray.get(demo_actor.start.remote(_settings_dict(base)))
        base = dataclasses.replace(
            base, workers=(*base.workers, *urls), tokenizer=tokenizer, demo=False
        )
    placements: list[dict[str, Any]] = [{}] * num_servers
    if per_node:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        placements = [
            {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
            for node in nodes
            for _ in range(num_servers)
        ]
    actors = [
        _ShardActor.options(**{**options, **placement}).remote()  # type: ignore[attr-defined]
        for placement in placements
    ]
    fleet = RayFleet((), base.api_key, actors, demo_actor)
    try:
        fleet.urls = tuple(ray.get([actor.bind.remote(host) for actor in actors]))
        shared = _settings_dict(base)
        ray.get([a.start.remote(shared, fleet.urls, i) for i, a in enumerate(actors)])
    except BaseException:
        fleet.shutdown()
        raise
    return fleet
