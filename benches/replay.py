"""Replay worker: answers every chat with one recorded SGLang emulator answer.

The real emulator spends ~100-200 ms of CPU building a 30k-token answer, which
on a 2-core machine makes it the bottleneck of every path and hides what the
proxy or the session server cost. This worker serves an answer recorded from
the emulator (``--answer FILE``: the response body bytes) at near-zero CPU, so
a throughput benchmark measures the process in the middle. The only per-request
change is ``prompt_tokens`` (meta_info and usage): the number of ``input_ids``
the request carried (msgspec reads just the fields it needs), so the session
server's strict validation passes; without ``input_ids`` the recorded value
stays. When the recorded answer has ``routed_experts`` and the request sends
``input_ids`` with ``return_routed_experts``, the blob is re-sized to the
positions asked for (prompt + completion - 1 - ``routed_experts_start_len``),
as the session server's R3 check requires.

Also serves ``/health``, ``/get_model_info`` and ``/v1/models`` like the
emulator, bare ASGI on hypercorn's trio worker.

    python benches/replay.py --answer answer.json --port 0
"""

from __future__ import annotations

import argparse
import base64
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson
import trio
from _common import read_body, serve_lifespan

from rollout_session.http.serving import start_server

_PROMPT_TOKENS = b"987654321987"
_ROUTED = b"@@routed-experts@@"
_PLACEHOLDER = re.compile(b"(" + _PROMPT_TOKENS + b"|" + _ROUTED + b")")


class _Request(msgspec.Struct):
    input_ids: list[int] | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


_DECODER = msgspec.json.Decoder(_Request)


@dataclass
class Template:
    """A recorded answer split around the values that depend on the request."""

    segments: list[bytes]
    prompt_tokens: int  # recorded
    completion_tokens: int
    routed_width: int  # int32 values per position in the recorded blob (0: none)
    recorded_blob: bytes
    random_experts: bytes  # source of blob bytes for other position counts

    def render(self, request: _Request) -> bytes:
        prompt = len(request.input_ids) if request.input_ids is not None else None
        blob: bytes | None = None
        if self.routed_width and prompt is not None and request.return_routed_experts:
            positions = max(
                prompt + self.completion_tokens - 1 - request.routed_experts_start_len, 0
            )
            size = positions * self.routed_width * 4
            source = self.random_experts * (1 + size // max(len(self.random_experts), 1))
            blob = base64.b64encode(source[:size])
        out = []
        for segment in self.segments:
            if segment == _PROMPT_TOKENS:
                out.append(str(prompt if prompt is not None else self.prompt_tokens).encode())
            elif segment == _ROUTED:
                out.append(blob if blob is not None else self.recorded_blob)
            else:
                out.append(segment)
        return b"".join(out)


def answer_template(answer: bytes) -> Template:
    """Split a recorded answer around prompt_tokens and routed_experts."""
    data = orjson.loads(answer)
    choice = data["choices"][0]
    meta = choice.get("meta_info") or data.get("meta_info")
    recorded = int(meta["prompt_tokens"])
    completion = int(meta["completion_tokens"])
    meta["prompt_tokens"] = int(_PROMPT_TOKENS)
    if isinstance(data.get("usage"), dict):
        data["usage"]["prompt_tokens"] = int(_PROMPT_TOKENS)
    blob = meta.get("routed_experts")
    width = 0
    if isinstance(blob, str):
        positions = recorded + completion - 1
        width = len(base64.b64decode(blob)) // 4 // max(positions, 1)
        meta["routed_experts"] = _ROUTED.decode()
    segments = [s for s in _PLACEHOLDER.split(orjson.dumps(data)) if s]
    experts = np.random.default_rng(0).integers(0, 256, 1024 * width, dtype="<i4").tobytes()
    recorded_blob = blob.encode() if isinstance(blob, str) else b""
    return Template(segments, recorded, completion, width, recorded_blob, experts)


def make_app(answer: bytes, model: str, tokenizer: str, context_length: int) -> Any:
    template = answer_template(answer)
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
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request_body = await read_body(receive)
        path = scope["path"]
        status = 200
        if path == "/v1/chat/completions" and scope["method"] == "POST":
            try:
                request = _DECODER.decode(request_body)
            except msgspec.DecodeError:
                request = _Request()
            body = template.render(request)
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
