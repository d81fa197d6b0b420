"""Raw passthrough proxy: the throughput ceiling for the session server's stack.

A minimal trio + hypercorn + httpx proxy with no parsing at all: every POST is
forwarded with its body unchanged to the same path on ``--upstream``, and the
upstream's status, content type and bytes come back. ``GET /health`` is
answered locally (a small JSON object, like the session server's). It uses the
package's own hypercorn settings (`rollout_session.http.serving.start_server`) and
the same per-worker httpx pool size as the server's default, so the only
difference left to the session server is the server's own work.

``--framework quart`` serves the same proxy as a Quart-Trio app instead of a
bare ASGI callable, to separate Quart's share from the server's own.

    python benches/passthrough.py --upstream http://127.0.0.1:30000 --port 0
"""

from __future__ import annotations

import argparse
import signal
from typing import Any

import httpx
import orjson
import trio
from _common import read_body, serve_lifespan

from rollout_session.http.serving import start_server

_HEALTH = orjson.dumps({"status": "ok"})


def make_client(upstream: str, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=upstream,
        timeout=httpx.Timeout(600.0, connect=5.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def asgi_proxy(client: httpx.AsyncClient) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"] == "/health":
            status, content_type, body = 200, b"application/json", _HEALTH
        else:
            response = await client.request(
                scope["method"],
                scope["path"],
                content=await read_body(receive),
                headers={"content-type": "application/json"},
            )
            status = response.status_code
            content_type = response.headers.get("content-type", "application/json").encode()
            body = response.content
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def quart_proxy(client: httpx.AsyncClient) -> Any:
    from quart import Response, request
    from quart_trio import QuartTrio

    app = QuartTrio("passthrough")
    app.config.update(MAX_CONTENT_LENGTH=None, BODY_TIMEOUT=None, RESPONSE_TIMEOUT=None)

    @app.get("/health")
    async def health() -> Response:
        return Response(_HEALTH, content_type="application/json")

    @app.post("/<path:path>")
    async def forward(path: str) -> Response:
        body = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        response = await client.post(
            f"/{path}", content=body, headers={"content-type": "application/json"}
        )
        return Response(
            response.content,
            status=response.status_code,
            content_type=response.headers.get("content-type", "application/json"),
        )

    return app


async def main(args: argparse.Namespace) -> None:
    client = make_client(args.upstream, args.connections)
    app = quart_proxy(client) if args.framework == "quart" else asgi_proxy(client)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            server = await start_server(nursery, app, host=args.host, port=args.port)
            print(f"passthrough ({args.framework}) listening on {server.url}", flush=True)
            async for _ in signals:
                break
            await server.aclose()
            await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upstream", required=True, help="base URL to forward to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--connections", type=int, default=64, help="httpx pool size")
    parser.add_argument("--framework", choices=("asgi", "quart"), default="asgi")
    trio.run(main, parser.parse_args())
