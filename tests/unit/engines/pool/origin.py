"""A bare keep-alive HTTP/1.1 server on a free loopback port that shows its
connections and requests: the worker the pool's unit tests talk to."""

from __future__ import annotations

from dataclasses import dataclass, field

import h11
import trio

__all__ = ["ANSWER", "LARGE", "Origin", "paths"]

ANSWER = b'{"ok": true}'
LARGE = bytes(range(256)) * (3 * 4096)  # 3 MiB


@dataclass
class Origin:
    """A keep-alive HTTP/1.1 server on a free port. ``/close`` answers and then
    closes the connection; ``/hold`` answers once `release` is set; ``/large``
    answers `LARGE` in one write; a path in `routes` answers its (status,
    body), any other path 200 `ANSWER`."""

    url: str = ""
    connections: int = 0  # accepted so far
    open_now: int = 0
    most_open: int = 0
    requests: list[tuple[int, bytes, dict[bytes, bytes]]] = field(default_factory=list)
    routes: dict[bytes, tuple[int, bytes]] = field(default_factory=dict)
    release: trio.Event = field(default_factory=trio.Event)
    changed: trio.Event = field(default_factory=trio.Event)  # a request came, a connection went

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, predicate: object) -> None:
        assert callable(predicate)
        while not predicate():
            await self.changed.wait()

    async def _held(self, stream: trio.SocketStream) -> bool:
        """Wait for `release`; False if the client disconnects first."""
        gone = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                gone = not await stream.receive_some()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await self.release.wait()
            nursery.cancel_scope.cancel()
        return not gone

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        number = self.connections
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some()
                    conn.receive_data(data)
                    if not data and conn.their_state is not h11.DONE:
                        return
                    continue
                if isinstance(event, h11.Request):
                    self.requests.append((number, event.target, dict(event.headers)))
                    self._notify()
                elif isinstance(event, h11.EndOfMessage):
                    target = self.requests[-1][1]
                    if target == b"/hold" and not await self._held(stream):
                        return  # the client went away while waiting
                    status, answer = self.routes.get(target, (200, ANSWER))
                    if target == b"/large":
                        answer = LARGE
                    headers = [("content-type", "application/json")]
                    headers.append(("content-length", str(len(answer))))
                    reply = b"".join(
                        conn.send(event) or b""
                        for event in (
                            h11.Response(status_code=status, headers=headers),
                            h11.Data(data=answer),
                            h11.EndOfMessage(),
                        )
                    )
                    await stream.send_all(reply)
                    if target == b"/close":
                        return
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return
        finally:
            self.open_now -= 1
            await stream.aclose()
            self._notify()


def paths(origin: Origin) -> list[bytes]:
    """The paths the origin was asked, in order."""
    return [target for _, target, _ in origin.requests]
