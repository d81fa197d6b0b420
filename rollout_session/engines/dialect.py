"""How the pool speaks to one kind of worker: what an admission check reads
(the served model), how a half-open circuit probes a worker, which headers
name a turn's session to a router in front of it, and how a worker scores a
token sequence (`scoring`).

One `WorkerDialect` per engine family, chosen once from ``--engine``: the
pool's bookkeeping (health, circuits, pins) is the same for every engine;
only these exchanges differ.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson

from .scoring import SGLANG_SCORING, ScoringDialect
from .sglang_chat.answer import parse_worker_answer
from .upstream import CHAT_PATH, ModelInfo, WorkerClient, chat_probe_body, fetch_model_info

__all__ = ["SGLANG_WORKERS", "WorkerDialect"]

# A probe's answer is checked like a turn's, but the pool does not know the
# vocabulary: any non-negative id passes.
ANY_VOCAB = 2**31 - 1


@dataclass(frozen=True, slots=True)
class WorkerDialect:
    name: str
    # What a worker serves, within a deadline; `UpstreamError` (with the
    # reason) when it is not this engine's worker or lists no model.
    read_model: Callable[[WorkerClient, float], Awaitable[ModelInfo]]
    # The half-open circuit's one-token request: its path, its body for the
    # served model, and the check of its 200 answer (`UpstreamMalformed`).
    probe_path: str
    probe_body: Callable[[str], bytes]
    check_probe: Callable[[bytes], object]
    # Headers whose value is the session id on every turn: a router in
    # front of the workers keeps a session on one worker by them.
    session_headers: tuple[bytes, ...]
    # The requests (path, body) that abort these in-flight turn requests,
    # by the id the engine sent: each then answers `abort` with what it
    # had sampled (a pause in abort mode).
    abort_requests: Callable[[list[str]], list[tuple[str, bytes]]]
    # How a worker scores a token sequence without sampling (a rescore).
    scoring: ScoringDialect


def _sglang_abort(rids: list[str]) -> list[tuple[str, bytes]]:
    # AbortReq takes one rid (io_struct.AbortReq; http_server.abort_request).
    return [("/abort_request", orjson.dumps({"rid": rid})) for rid in rids]


def _check_sglang_probe(body: bytes) -> object:
    return parse_worker_answer(body, sent_prompt_tokens=1, vocab_size=ANY_VOCAB)


SGLANG_WORKERS = WorkerDialect(
    name="sglang",
    read_model=fetch_model_info,
    probe_path=CHAT_PATH,
    probe_body=chat_probe_body,
    check_probe=_check_sglang_probe,
    # sgl-model-gateway's routing key; SGLang itself ignores it.
    session_headers=(b"x-smg-routing-key",),
    abort_requests=_sglang_abort,
    scoring=SGLANG_SCORING,
)
