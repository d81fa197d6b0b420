"""A raw HTTP/1.1 client connection: the request's head and body sent
separately, as clients write them, and responses read off one keep-alive
connection. Just enough for the server's responses (all carry a
content-length)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import trio


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # names lowercased; the last value of a repeated name
    body: bytes

    @property
    def closes(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


class RawConnection:
    def __init__(self, stream: trio.SocketStream, host: str) -> None:
        self._stream = stream
        self._host = host
        self._buffer = bytearray()

    @classmethod
    async def open(cls, url: str) -> RawConnection:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return cls(await trio.open_tcp_stream(host, int(port)), host)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def send_head(
        self, method: str, path: str, headers: dict[str, str] | None = None
    ) -> None:
        lines = [f"{method} {path} HTTP/1.1", f"host: {self._host}"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        await self.send(("\r\n".join(lines) + "\r\n\r\n").encode())

    async def send(self, data: bytes) -> None:
        await self._stream.send_all(data)

    async def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
    ) -> RawResponse:
        await self.send_head(method, path, {**(headers or {}), "content-length": str(len(body))})
        await self.send(body)
        return await self.response()

    async def response(self) -> RawResponse:
        """The next response. Cancelling it loses nothing: bytes already
        received stay buffered for the next call."""
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            await self._fill()
        status_line, *lines = self._buffer[:end].decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        while len(self._buffer) < end + 4 + length:
            await self._fill()
        body = bytes(self._buffer[end + 4 : end + 4 + length])
        del self._buffer[: end + 4 + length]
        return RawResponse(int(status_line.split()[1]), headers, body)

    def has_unread_bytes(self) -> bool:
        """Whether any byte from the server is waiting (without waiting)."""
        if self._buffer:
            return True
        # A peek on a duplicate of the descriptor: trio's socket has no
        # synchronous receive, and the peek consumes nothing.
        with socket.socket(fileno=os.dup(self._stream.socket.fileno())) as peer:
            try:
                return bool(peer.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except BlockingIOError:
                return False

    async def closed_by_server(self) -> bool:
        """Wait for the server to close the connection (True), or for any
        byte it sends instead (False)."""
        if self._buffer:
            return False
        try:
            data = await self._stream.receive_some(65536)
        except trio.BrokenResourceError:  # reset: closed with our bytes unread
            return True
        self._buffer += data
        return not data

    async def _fill(self) -> None:
        data = await self._stream.receive_some(65536)
        if not data:
            raise EOFError("the server closed the connection")
        self._buffer += data
