"""What the trainer gets: the export document and the sample view
(docs/training.md#the-export-document-schema_version-1).

`export_document` runs on the event loop and builds the token arrays afresh
from the trajectory's chunks (a memcpy of ~4 bytes per token, plus the
derived mask and logprobs) so the document is a consistent snapshot even if
the session commits or rolls back a turn meanwhile; `serialize` may then run
on a worker thread. Token arrays go to orjson as numpy arrays
(``OPT_SERIALIZE_NUMPY``): no per-token Python objects on the way out.

Optional parts (``?include=turns,messages,routed_experts``) let a trainer skip
what it does not need; the default is the whole document.

The sample view (``?format=sample``) uses the field names of slime/miles'
``Sample``: ``tokens`` (prompt + response), ``response_length``, and
``loss_mask`` / ``rollout_log_probs`` over the response part only (tool
results and other observations inside the response have mask 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final, Literal

import orjson
import pybase64

from .errors import InvalidRequest
from .sessions import Session
from .trajectory import IdArray

__all__ = [
    "DEFAULT_PARTS",
    "OPTIONAL_PARTS",
    "SCHEMA_VERSION",
    "ExportStatus",
    "export_document",
    "parse_include",
    "sample_view",
    "serialize",
]

SCHEMA_VERSION = 1
ExportStatus = Literal["open", "closed", "expired"]
OPTIONAL_PARTS: Final = frozenset({"turns", "messages", "routed_experts", "pieces"})
# Pieces (each token decoded) are for people inspecting, not for training.
DEFAULT_PARTS: Final = OPTIONAL_PARTS - {"pieces"}

# Sample.Status of slime/miles from the last turn's finish reason.
_SAMPLE_STATUS: Final = {
    "stop": "completed",
    "tool_calls": "completed",
    "length": "truncated",
    "abort": "aborted",
}


def parse_include(raw: str | None) -> frozenset[str]:
    if raw is None:
        return DEFAULT_PARTS
    parts = frozenset(p.strip() for p in raw.split(",") if p.strip())
    unknown = parts - OPTIONAL_PARTS
    if unknown:
        raise InvalidRequest(
            f"unknown include part(s) {sorted(unknown)}; known: {sorted(OPTIONAL_PARTS)}",
            param="include",
        )
    return parts


def export_document(
    session: Session,
    status: ExportStatus,
    include: Iterable[str] = DEFAULT_PARTS,
    decode_pieces: Callable[[IdArray], list[str]] | None = None,
) -> dict[str, Any]:
    trajectory = session.trajectory
    tokens = trajectory.tokens
    turns = trajectory.turns
    parts = frozenset(include)
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "session_id": session.id,
        "status": status,
        "metadata": session.metadata,
        "created_at": session.created_at,
        "closed_at": session.closed_at,
        "model": session.model,
        "token_ids": tokens.ids,
        "loss_mask": tokens.mask,
        "logprobs": tokens.logprobs,
        "prompt_length": turns[0].completion_start if turns else len(tokens),
    }
    if "turns" in parts:
        doc["turns"] = [
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
        ]
    if "messages" in parts:
        # Decoded from the compact records here, on the loop: a snapshot.
        doc["messages"] = session.messages
    if "pieces" in parts and decode_pieces is not None:
        doc["pieces"] = decode_pieces(doc["token_ids"])
    if "routed_experts" in parts and trajectory.experts_width is not None:
        width = trajectory.experts_width
        doc["routed_experts"] = {
            "dtype": "int32",
            # [positions, values per position]; values = layers × top-k of the model.
            "shape": [len(trajectory.experts) // (4 * width), width],
            "data": pybase64.b64encode_as_string(trajectory.experts),
        }
    return doc


def sample_view(session: Session) -> dict[str, Any]:
    """The trajectory as one RL sample (slime/miles field names)."""
    trajectory = session.trajectory
    tokens = trajectory.tokens
    turns = trajectory.turns
    start = turns[0].completion_start if turns else len(tokens)
    last = turns[-1].finish_reason if turns else None
    return {
        "session_id": session.id,
        "tokens": tokens.ids,
        "response_length": len(tokens) - start,
        "loss_mask": tokens.mask[start:],
        "rollout_log_probs": tokens.logprobs[start:],
        "status": _SAMPLE_STATUS.get(last or "", "pending" if not turns else "completed"),
        "metadata": session.metadata,
    }


def serialize(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
