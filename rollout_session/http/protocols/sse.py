"""OpenAI server-sent events for ``stream: true`` turns, built after the fact.

A streamed turn is still generated non-streaming (its token ids and logprobs
must be exact) and committed like any other
(docs/architecture.md#one-turn-hop-by-hop). This module owns
what the agent then receives: the worker's complete answer turned into the
chunk sequence an OpenAI server streams — a role chunk, ``reasoning_content``
and ``content`` pieces, tool calls as ``delta.tool_calls`` (id, type and name
first, then the arguments), a final chunk with ``finish_reason``, a usage
chunk (``choices: []``) when asked, then ``data: [DONE]``.

Pure functions, no I/O and no session state: the route calls `sse_body` once
per streamed turn (on the CPU limiter when the answer is large).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Final

import orjson

from ...turn.request import StreamMode
from ..edge import RawResponse

__all__ = [
    "LOGPROB_ENTRIES",
    "PIECE_CHARS",
    "SSE_CONTENT_TYPE",
    "SSE_HEADERS",
    "encode_events",
    "encode_typed_events",
    "sse_answer",
    "sse_body",
    "stream_chunks",
    "text_pieces",
]

SSE_CONTENT_TYPE: Final = "text/event-stream; charset=utf-8"
# no-cache: a stream is never replayed; X-Accel-Buffering: nginx in front of
# the server must not hold the events back.
SSE_HEADERS: Final = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_SSE_PAIRS: Final = (
    (b"content-type", SSE_CONTENT_TYPE.encode()),
    *((k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()),
)


def sse_answer(events: bytes) -> RawResponse:
    """A fast route's 200 answer carrying a whole event stream."""
    return RawResponse(200, list(_SSE_PAIRS), events)


# Text is sent in pieces of at most this many characters. Not for pacing
# (everything is already generated) but to bound each event: line-based SSE
# readers have line limits (aiohttp's is 64 KiB), and a 100k-character answer
# in one event would break them. Large enough that the chunk envelope
# (~200 bytes) stays a small overhead.
PIECE_CHARS: Final = 1024
# Logprob entries per chunk, for the same reason (an entry with 20
# top_logprobs is ~1.5 kB).
LOGPROB_ENTRIES: Final = 16


def text_pieces(text: Any, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in events of at most `size` characters (nothing unless a string):
    every protocol's SSE answer (chat, Responses, Messages) cuts it so."""
    if isinstance(text, str):
        for start in range(0, len(text), size):
            yield text[start : start + size]


def _arguments(value: Any) -> str:
    # SGLang sends a JSON string; a worker that sends an object gets it encoded.
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def _deltas(message: dict[str, Any], piece_chars: int) -> Iterator[dict[str, Any]]:
    yield {"role": "assistant", "content": ""}
    for piece in text_pieces(message.get("reasoning_content"), piece_chars):
        yield {"reasoning_content": piece}
    for piece in text_pieces(message.get("content"), piece_chars):
        yield {"content": piece}
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        head = {"name": function.get("name"), "arguments": ""}
        yield {
            "tool_calls": [
                {"index": index, "id": call.get("id"), "type": "function", "function": head}
            ]
        }
        for piece in text_pieces(_arguments(function.get("arguments", "")), piece_chars):
            yield {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


def _finish_reason(choice: dict[str, Any]) -> str:
    reason = choice.get("finish_reason")
    if isinstance(reason, str):
        return reason
    # SGLang's meta_info form, as the turn path reads it.
    meta = choice.get("meta_info") or {}
    kind = (meta.get("finish_reason") or {}).get("type")
    return kind if isinstance(kind, str) else "stop"


def stream_chunks(
    answer: dict[str, Any], mode: StreamMode, *, piece_chars: int = PIECE_CHARS
) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects for one complete chat answer.

    Ids, ``created`` and ``model`` are the answer's own, so a streamed and a
    non-streamed answer to the same request carry the same identity.
    """
    choice = answer["choices"][0]
    envelope: dict[str, Any] = {
        "id": answer.get("id", ""),
        "object": "chat.completion.chunk",
        "created": answer.get("created") or int(time.time()),
        "model": answer.get("model", ""),
    }
    if mode.include_usage:
        # OpenAI: with include_usage every chunk but the last has usage: null.
        envelope["usage"] = None

    def chunk(
        delta: dict[str, Any], *, logprobs: Any = None, finish: str | None = None
    ) -> dict[str, Any]:
        entry = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**envelope, "choices": [entry]}

    chunks = [chunk(delta) for delta in _deltas(choice["message"], piece_chars)]
    logprobs = choice.get("logprobs")
    if mode.logprobs and isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
        # Clients concatenate logprobs.content across chunks (as for text).
        entries = logprobs["content"]
        for start in range(0, len(entries), LOGPROB_ENTRIES):
            chunks.append(chunk({}, logprobs={"content": entries[start : start + LOGPROB_ENTRIES]}))
    chunks.append(chunk({}, finish=_finish_reason(choice)))
    if mode.include_usage:
        chunks.append({**envelope, "choices": [], "usage": answer.get("usage")})
    return chunks


def encode_events(chunks: Iterable[dict[str, Any]]) -> bytes:
    """SSE framing: ``data: {chunk}\\n\\n`` per chunk, then ``data: [DONE]\\n\\n``."""
    events = [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks]
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def encode_typed_events(events: Iterable[dict[str, Any]]) -> bytes:
    """SSE framing of the Responses and Messages APIs: ``event: {type}`` then
    ``data: {event}`` per event, no ``[DONE]``."""
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events
    )


def sse_body(worker_body: bytes, mode: StreamMode) -> bytes:
    """The whole SSE response for a worker's (already validated) 200 body.

    Sent as one body: every event exists before the first byte goes out, so
    per-event writes would only add overhead; clients read it event by event
    all the same.
    """
    return encode_events(stream_chunks(orjson.loads(worker_body), mode))
