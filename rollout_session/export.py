"""The export document (DESIGN §6), serialised straight from the compact store.

`export_document` runs on the event loop and copies the token arrays (a
memcpy, ~9 bytes per token) so the document is a consistent snapshot even if
the session commits or rolls back a turn meanwhile; `serialize` may then run
on a worker thread. Token arrays go to orjson as numpy arrays
(``OPT_SERIALIZE_NUMPY``): no per-token Python objects on the way out.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

from .sessions import Session

__all__ = ["SCHEMA_VERSION", "ExportStatus", "export_document", "serialize"]

SCHEMA_VERSION = 1
ExportStatus = Literal["open", "closed", "expired"]


def export_document(session: Session, status: ExportStatus) -> dict[str, Any]:
    trajectory = session.trajectory
    tokens = trajectory.tokens
    turns = trajectory.turns
    return {
        "schema_version": SCHEMA_VERSION,
        "session_id": session.id,
        "status": status,
        "metadata": session.metadata,
        "created_at": session.created_at,
        "closed_at": session.closed_at,
        "model": session.model,
        "token_ids": tokens.ids.copy(),
        "loss_mask": tokens.mask.copy(),
        "logprobs": tokens.logprobs.copy(),
        "prompt_length": turns[0].completion_start if turns else len(tokens),
        "turns": [
            {
                "index": t.index,
                "prompt_start": t.prompt_start,
                "completion_start": t.completion_start,
                "completion_end": t.completion_end,
                "finish_reason": t.finish_reason,
                "worker": t.worker,
                "weight_version": t.weight_version,
                "cached_tokens": t.cached_tokens,
                "upstream_latency_s": t.upstream_latency_s,
                "created_at": t.created_at,
            }
            for t in turns
        ],
        # Commits replace this list, never mutate it: a reference is a snapshot.
        "messages": session.messages,
    }


def serialize(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
