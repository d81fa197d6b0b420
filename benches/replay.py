"""Replay worker: answers every chat with one recorded SGLang emulator answer.

The real emulator spends ~100-200 ms of CPU building a 30k-token answer, which
on a 2-core machine makes it the bottleneck of every path and hides what the
proxy or the session server cost. This worker serves an answer recorded from
the emulator (``--answer FILE``: the response body bytes) at near-zero CPU, so
a throughput benchmark measures the process in the middle. The only per-request
change is ``prompt_tokens`` (meta_info and usage): the number of ``input_ids``
the request carried (msgspec reads just that field), so the session server's
strict validation passes; without ``input_ids`` the recorded value stays.

Also serves ``/health``, ``/get_model_info`` and ``/v1/models`` like the
emulator, bare ASGI on hypercorn's trio worker.

    python benches/replay.py --answer answer.json --port 0
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any

import msgspec
import orjson
import trio

from rollout_session.serving import start_server

_SENTINEL = 987_654_321_987


class _Request(msgspec.Struct):
    input_ids: list[int] | None = None


_DECODER = msgspec.json.Decoder(_Request)


def answer_template(answer: bytes) -> tuple[list[bytes], int]:
    """Split a recorded answer around its prompt_tokens values."""
    data = orjson.loads(answer)
    choice = data["choices"][0]
    meta = choice.get("meta_info") or data.get("meta_info")
    recorded = int(meta["prompt_tokens"])
    meta["prompt_tokens"] = _SENTINEL
    if isinstance(data.get("usage"), dict):
        data["usage"]["prompt_tokens"] = _SENTINEL
    return orjson.dumps(data).split(str(_SENTINEL).encode()), recorded


def make_app(answer: bytes, model: str, tokenizer: str, context_length: int) -> Any:
    parts, recorded = answer_template(answer)
    fixed = {
        "/health": orjson.dumps({}),
        "/get_model_info": orjson.dumps(
            {"model_path": model, "tokenizer_path": tokenizer, "is_generation": True}
        ),
        "/v1/models": orjson.dumps(
            {"object": "list", "data": [{"id": model, "max_model_len": context_length}]}
        ),
    }
    stats = {"chats": 0}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        path = scope["path"]
        status = 200
        if path == "/v1/chat/completions" and scope["method"] == "POST":
            try:
                ids = _DECODER.decode(b"".join(chunks)).input_ids
            except msgspec.DecodeError:
                ids = None
            count = str(len(ids) if ids is not None else recorded).encode()
            body = count.join(parts)
            stats["chats"] += 1
        elif path == "/emulator/stats":
            body = orjson.dumps(stats)
        elif path in fixed:
            body = fixed[path]
        else:
            status, body = 404, b'{"error": "not found"}'
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


async def main(args: argparse.Namespace) -> None:
    app = make_app(
        args.answer.read_bytes(), args.model_name, args.tokenizer or "", args.context_length
    )
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            server = await start_server(nursery, app, host=args.host, port=args.port)
            print(f"replay worker listening on {server.url}", flush=True)
            async for _ in signals:
                break
            await server.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--answer", type=Path, required=True, help="recorded answer body")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model-name", default="rollout-session/emulator")
    parser.add_argument("--tokenizer", help="reported tokenizer_path")
    parser.add_argument("--context-length", type=int, default=262144)
    trio.run(main, parser.parse_args())
