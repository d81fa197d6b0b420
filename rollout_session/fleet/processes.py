"""``serve --processes N``: one fleet of N shards on this host, a process each.

The parent binds the N sockets (``--port`` and the N-1 after it, or N free
ports for ``--port 0``), so a port in use fails the start at once; names
the fleet's URLs from them (or takes ``--fleet``); starts, in demo mode, the
emulator workers every shard shares; then starts each shard as a plain
``rollout-session serve --fleet … --shard i --listen-fd FD`` on its inherited
socket, with ``--journal DIR/shard-i`` under ``--journal DIR``. It keeps no
copy of the sockets: a shard that is gone refuses connections instead of
leaving them in a backlog nobody reads.

A shard's lines go to the parent's output prefixed ``[shard i]``; once all
listen, the parent prints ``rollout-session fleet of N shards: URL …``.
SIGINT/SIGTERM are passed on to every shard, each stops gracefully, and the
parent exits once all have (0 if every shard exited cleanly). A shard that
dies is reported with the command that starts it again, and is not
restarted: its sessions fail (connection refused) until it runs again,
the other shards go on. Decisions: docs/deploy.md#a-fleet.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import orjson
import trio

from ..cli.demo import start_demo_workers
from ..cli.options import (
    ENV_PREFIX,
    SERVE_OPTIONS,
    URL_LISTS,
    add_serve_arguments,
    settings_from_args,
)
from ..config import Settings
from ..http.serving import CannotListen

__all__ = ["bind_sockets", "fleet_urls", "run_fleet", "shard_command"]

# Passed to a shard in its environment, never on its command line (which
# every local user can read in /proc).
_SECRETS = ("api_key", "admin_api_key")
_DEFAULTS = Settings(demo=True)


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` TCP sockets bound (not listening: a shard listens once it has
    started) on `port` and the ports after it, or on free ports for 0."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for i in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted connections inherit it (hypercorn sets it on sockets it binds).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            at = 0 if port == 0 else port + i
            try:
                sock.bind((host, at))
            except OSError as exc:
                raise CannotListen(f"cannot listen on {host}:{at}: {exc}") from exc
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def fleet_urls(host: str, sockets: list[socket.socket]) -> tuple[str, ...]:
    """The URLs the shards are reached at: their host (this machine's name
    when they listen on every address) and bound ports."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    name = f"[{host}]" if ":" in host else host
    return tuple(f"http://{name}:{sock.getsockname()[1]}" for sock in sockets)


def _flags(settings: Settings) -> list[str]:
    """Command-line flags for `settings` (the secrets left out)."""
    out: list[str] = []
    for flag, dest, _, _ in SERVE_OPTIONS:
        value = getattr(settings, dest)
        if dest in _SECRETS or value == getattr(_DEFAULTS, dest):
            continue
        if value is None:
            text = "none"
        elif isinstance(value, frozenset):
            text = ",".join(sorted(value))
        elif isinstance(value, Mapping):
            text = orjson.dumps(dict(value)).decode()
        else:
            text = str(value)
        out += [flag, text]
    for flag, dest, _ in URL_LISTS:  # --worker, --teacher-worker, --fleet
        for url in getattr(settings, dest):
            out += [flag, url]
    for field in dataclasses.fields(Settings):
        if field.type == "bool" and getattr(settings, field.name):
            out.append("--" + field.name.replace("_", "-"))
    return out


def shard_command(settings: Settings, listen_fd: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start `settings` as a plain
    ``serve`` on `listen_fd`. Checked by parsing it back: a setting the
    flags cannot carry refuses the start rather than differ in a shard."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    for name in _SECRETS:
        if getattr(settings, name) is not None:
            env[ENV_PREFIX + name.upper()] = getattr(settings, name)
    flags = [*_flags(settings), "--listen-fd", str(listen_fd)]
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env)
    parsed = settings_from_args(parser.parse_args(flags))
    if parsed != settings:
        differ = [
            f.name
            for f in dataclasses.fields(Settings)
            if getattr(parsed, f.name) != getattr(settings, f.name)
        ]
        raise ValueError(f"a shard's command line cannot carry {', '.join(differ)}")
    return [sys.executable, "-m", "rollout_session", "serve", *flags], env


async def _relay(prefix: str, stream: trio.abc.ReceiveStream, listening: trio.Event) -> None:
    """The shard's output, each line prefixed; `listening` once it listens."""
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            text = line.decode(errors="replace")
            if text.startswith("rollout-session listening on "):
                listening.set()
            print(f"{prefix} {text}", flush=True)


class _Shard:
    """One shard of the fleet: its command (checked before any shard starts)
    and, once started, its process."""

    def __init__(self, base: Settings, urls: tuple[str, ...], i: int, sock: socket.socket) -> None:
        journal = None if base.journal is None else str(Path(base.journal) / f"shard-{i}")
        port = sock.getsockname()[1]  # its own, for a restart by hand
        own = replace(base, port=port, processes=1, fleet=urls, shard=i, journal=journal)
        self.command, self._env = shard_command(own, sock.fileno())
        self.index = i
        self.url = urls[i]
        self._fd = sock.fileno()
        self.listening = trio.Event()
        self.process: trio.Process | None = None

    async def start(self, nursery: trio.Nursery) -> None:
        self.process = await trio.lowlevel.open_process(
            self.command, stdout=subprocess.PIPE, env=self._env, pass_fds=[self._fd]
        )
        print(f"[shard {self.index}] pid {self.process.pid} for {self.url}", flush=True)
        assert self.process.stdout is not None
        nursery.start_soon(_relay, f"[shard {self.index}]", self.process.stdout, self.listening)


async def run_fleet(settings: Settings) -> int:
    """Run the fleet until SIGINT/SIGTERM; the exit code (module doc)."""
    stopping = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            sockets = bind_sockets(settings.host, settings.port, settings.processes)
            urls = settings.fleet or fleet_urls(settings.host, sockets)
            base = settings
            if settings.demo:
                base = replace(await start_demo_workers(nursery, settings), demo=False)
            try:
                shards = [_Shard(base, urls, i, sock) for i, sock in enumerate(sockets)]
                for shard in shards:
                    await shard.start(nursery)
            finally:
                for sock in sockets:
                    sock.close()  # each shard has its copy
            exits: trio.MemorySendChannel[_Shard]
            exits, exited = trio.open_memory_channel[_Shard](len(shards))

            async def watch(shard: _Shard) -> None:
                assert shard.process is not None
                await shard.process.wait()
                await exits.send(shard)

            for shard in shards:
                nursery.start_soon(watch, shard)

            async def started() -> None:
                for shard in shards:
                    await shard.listening.wait()
                print(
                    f"rollout-session fleet of {len(shards)} shards: {' '.join(urls)}", flush=True
                )

            nursery.start_soon(started)

            def stop_all() -> None:
                for shard in shards:
                    assert shard.process is not None
                    if shard.process.returncode is None:
                        shard.process.send_signal(signal.SIGTERM)

            async def on_signal() -> None:
                nonlocal stopping
                async for _ in signals:
                    stopping = True
                    stop_all()

            nursery.start_soon(on_signal)
            failed = False
            for _ in shards:
                shard = await exited.receive()
                assert shard.process is not None
                code = shard.process.returncode
                if stopping and code == 0:
                    continue
                failed = True
                if not shard.listening.is_set():
                    # A start that failed fails the fleet: no half fleets.
                    print(f"rollout-session: shard {shard.index} did not start", file=sys.stderr)
                    stopping = True
                    stop_all()
                elif not stopping:
                    print(
                        f"rollout-session: shard {shard.index} ({shard.url}, pid "
                        f"{shard.process.pid}) exited with {code}: its sessions fail until it "
                        f"runs again (the other shards go on). To start it again: "
                        f"{' '.join(_restart_command(shard.command))}",
                        file=sys.stderr,
                        flush=True,
                    )
            nursery.cancel_scope.cancel()
    return 1 if failed else 0


def _restart_command(command: list[str]) -> list[str]:
    """A shard's command, binding its port itself instead of the parent's socket."""
    at = command.index("--listen-fd")
    return [*command[:at], *command[at + 2 :]]
