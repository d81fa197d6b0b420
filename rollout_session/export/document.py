"""What the trainer gets: the export document and its sample and steps views
(docs/training.md#the-export-document-schema_version-3).

`export_document` runs on the event loop and builds the token arrays afresh
from the trajectory's chunks (a memcpy of ~4 bytes per token, plus the
derived mask and logprobs) so the document is a consistent snapshot even if
the session commits or rolls back a turn meanwhile; `serialize` may then run
on a worker thread. Token arrays go to orjson as numpy arrays
(``OPT_SERIALIZE_NUMPY``): no per-token Python objects on the way out.

A session is a list of segments (`session/segments.py`); the document
(schema 3) carries every one under ``segments``, each array once. ``?schema=1``
asks for v1's document instead: the last segment's fields at the top level,
no ``segments``. (Schema 2 carried both, so every DELETE wrote the last
segment twice.)

Optional parts (``?include=turns,messages,routed_experts``) let a trainer skip
what it does not need; the default is the whole document.

The sample view (``?format=sample``) is one sample per segment with the field
names of slime/miles' ``Sample``: ``tokens`` (prompt + response),
``response_length``, and ``loss_mask`` / ``rollout_log_probs`` over the
response part only (tool results and other observations inside the response
have mask 0), all sharing the session id as ``episode_id``. The steps view
(``?format=steps``) is one record per turn for step-wise trainers. Both
views are unchanged since schema 2 and say so (``schema_version`` 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import orjson
import pybase64

from ..errors import InvalidRequest
from ..session.segments import Segment
from ..session.session import Session
from ..session.trajectory import Turn
from ..tokens import IdArray
from .rescores import rescore_fields

__all__ = [
    "DEFAULT_PARTS",
    "OPTIONAL_PARTS",
    "SCHEMAS",
    "SCHEMA_VERSION",
    "VIEWS_SCHEMA_VERSION",
    "ExportQuery",
    "ExportStatus",
    "export_document",
    "parse_include",
    "parse_query",
    "sample_view",
    "serialize",
    "steps_view",
    "v1_document",
    "view_document",
]

# The document's: 3 carries each segment once (2 also repeated the last
# segment's fields at the top level; 1 had no segments).
SCHEMA_VERSION: Final = 3
# What `?schema=` may ask for: v1's document (the last segment) or the current.
SCHEMAS: Final = (1, SCHEMA_VERSION)
# The sample and steps views have not changed since schema 2.
VIEWS_SCHEMA_VERSION: Final = 2
ExportStatus = Literal["open", "closed", "expired"]
VIEWS: Final = ("document", "sample", "steps")
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


@dataclass(frozen=True, slots=True)
class ExportQuery:
    """An export's query parameters: ``format``, ``include``, ``schema``."""

    view: str = "document"
    include: frozenset[str] = DEFAULT_PARTS
    schema: int = SCHEMA_VERSION


def parse_query(args: Mapping[str, str]) -> ExportQuery:
    """``?format=`` (document, sample, steps), ``?include=`` and ``?schema=``
    (1 or 3, documents only) of `GET …/trajectory` and `DELETE`."""
    view = args.get("format", "document")
    if view not in VIEWS:
        raise InvalidRequest(f"format must be one of {', '.join(VIEWS)}", param="format")
    return ExportQuery(view, parse_include(args.get("include")), _parse_schema(args, view))


def _parse_schema(args: Mapping[str, str], view: str) -> int:
    raw = args.get("schema")
    if raw is None:
        return SCHEMA_VERSION
    if view != "document":
        raise InvalidRequest(
            f"schema is for format=document; the {view} view has one shape "
            f"(schema_version {VIEWS_SCHEMA_VERSION})",
            param="schema",
        )
    if raw not in {str(v) for v in SCHEMAS}:
        raise InvalidRequest(
            "schema must be 1 (v1's document: the last segment's fields at the top level) "
            f"or {SCHEMA_VERSION} (every segment once, the default); schema 2 is not served: "
            f"its segments are schema {SCHEMA_VERSION}'s, its top-level fields schema 1's",
            param="schema",
        )
    return int(raw)


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


def view_document(
    session: Session,
    view: str,
    status: ExportStatus,
    include: Iterable[str] = DEFAULT_PARTS,
    decode_pieces: Callable[[IdArray], list[str]] | None = None,
    schema: int = SCHEMA_VERSION,
) -> dict[str, Any]:
    """The `?format=` view of a session: ``document`` (`schema` 3, or 1:
    `v1_document`), ``sample`` or ``steps``."""
    if view == "document":
        if schema == 1:
            return v1_document(session, status, include, decode_pieces)
        return export_document(session, status, include, decode_pieces)
    if view == "sample":
        return sample_view(session, status)
    if view == "steps":
        return steps_view(session, status)
    raise InvalidRequest(f"format must be one of {', '.join(VIEWS)}", param="format")


def _turn_dict(t: Turn) -> dict[str, Any]:
    return {
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
        # Positions in the segment's token_ids, like the turn's own spans.
        "weight_versions": [
            {
                "start": t.completion_start + s.start,
                "end": t.completion_start + s.end,
                "version": s.version,
            }
            for s in t.weight_versions
        ],
        "continuations": [
            {
                "start": t.completion_start + c.start,
                "worker": c.worker,
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
                "discarded_tokens": c.discarded,
            }
            for c in t.continuations
        ],
        # The sampling parameters the engine sent (null: the worker's own default).
        "sampling": None if t.sampling is None else dict(t.sampling),
    }


def _token_versions(turns: Iterable[Turn], start: int, end: int) -> list[str | None]:
    """The policy version of every token in [start, end): the sampling
    turn's span version for sampled tokens, None for the rest (mask 0)."""
    out: list[str | None] = [None] * (end - start)
    for t in turns:
        for s in t.weight_versions:
            a, b = t.completion_start + s.start - start, t.completion_start + s.end - start
            out[max(a, 0) : max(b, 0)] = [s.version] * (max(b, 0) - max(a, 0))
    return out


def _segment_document(
    segment: Segment,
    index: int,
    parts: frozenset[str],
    decode_pieces: Callable[[IdArray], list[str]] | None,
) -> dict[str, Any]:
    trajectory = segment.trajectory
    tokens = trajectory.tokens
    turns = trajectory.turns
    doc: dict[str, Any] = {
        "index": index,
        "branch": segment.branch.as_dict() if segment.branch is not None else None,
        "token_ids": tokens.ids,
        "loss_mask": tokens.mask,
        "logprobs": tokens.logprobs,
        "prompt_length": turns[0].completion_start if turns else len(tokens),
    }
    # By label: each aligned with token_ids (docs/training.md#rescoring).
    doc["rescores"] = {
        label: rescore_fields(r, doc["logprobs"], doc["loss_mask"], turns)
        for label, r in trajectory.rescores.items()
    }
    if "turns" in parts:
        doc["turns"] = [_turn_dict(t) for t in turns]
    if "messages" in parts:
        # Decoded from the compact records here, on the loop: a snapshot.
        doc["messages"] = segment.conversation.messages()
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


def _session_fields(session: Session, status: ExportStatus, schema: int) -> dict[str, Any]:
    return {
        "schema_version": schema,
        "session_id": session.id,
        "status": status,
        "metadata": session.metadata,
        "created_at": session.created_at,
        "closed_at": session.closed_at,
        "model": session.model,
        # The trainer's sampling pinned on the session (null: none).
        "sampling": session.sampling,
    }


def export_document(
    session: Session,
    status: ExportStatus,
    include: Iterable[str] = DEFAULT_PARTS,
    decode_pieces: Callable[[IdArray], list[str]] | None = None,
) -> dict[str, Any]:
    """The document (schema 3): the session's fields and every segment,
    each segment's arrays once."""
    parts = frozenset(include)
    segments = [
        _segment_document(segment, i, parts, decode_pieces)
        for i, segment in enumerate(session.segments())
    ]
    return {
        **_session_fields(session, status, SCHEMA_VERSION),
        "num_segments": len(segments),
        "rollbacks": [r.as_dict() for r in session.rollbacks],
        "segments": segments,
    }


def v1_document(
    session: Session,
    status: ExportStatus,
    include: Iterable[str] = DEFAULT_PARTS,
    decode_pieces: Callable[[IdArray], list[str]] | None = None,
) -> dict[str, Any]:
    """``?schema=1``: v1's document, the last segment's fields at the top
    level (the whole trajectory only when ``num_segments`` is 1)."""
    segments = session.segments()
    last = _segment_document(segments[-1], len(segments) - 1, frozenset(include), decode_pieces)
    del last["index"], last["branch"]
    return {
        **_session_fields(session, status, 1),
        **last,
        # Not v1's: what a v1 reader needs to see that it has the last segment only.
        "num_segments": len(segments),
    }


def sample_view(session: Session, status: ExportStatus = "open") -> dict[str, Any]:
    """One RL sample per segment (slime/miles field names), sharing the
    session id as their episode id."""
    samples = []
    for index, segment in enumerate(session.segments()):
        tokens = segment.trajectory.tokens
        turns = segment.trajectory.turns
        start = turns[0].completion_start if turns else len(tokens)
        last = turns[-1].finish_reason if turns else None
        samples.append(
            {
                "episode_id": session.id,
                "segment": index,
                "branch": segment.branch.as_dict() if segment.branch is not None else None,
                "tokens": tokens.ids,
                "response_length": len(tokens) - start,
                "loss_mask": tokens.mask[start:],
                "rollout_log_probs": tokens.logprobs[start:],
                # The policy that sampled each response token (None: mask 0).
                "rollout_weight_versions": _token_versions(turns, start, len(tokens)),
                # Each rescore's logprobs over the response part, by label
                # (null where it has none).
                "rescore_log_probs": {
                    label: rescore.aligned(len(tokens))[start:]
                    for label, rescore in segment.trajectory.rescores.items()
                },
                "status": _SAMPLE_STATUS.get(last or "", "pending" if not turns else "completed"),
                # Each turn's sampling parameters, in order (the behaviour policy).
                "rollout_sampling": [
                    None if t.sampling is None else dict(t.sampling) for t in turns
                ],
                "metadata": session.metadata,
            }
        )
    return {
        "schema_version": VIEWS_SCHEMA_VERSION,
        "session_id": session.id,
        "status": status,
        "samples": samples,
    }


def steps_view(session: Session, status: ExportStatus = "open") -> dict[str, Any]:
    """One record per turn, in the order they were taken, for step-wise
    trainers (SkyRL, rLLM): the whole prompt the model saw and what it
    sampled. ``is_last`` marks the session's last turn."""
    steps: list[dict[str, Any]] = []
    for index, segment in enumerate(session.segments()):
        trajectory = segment.trajectory
        tokens = trajectory.tokens
        for turn in trajectory.turns:
            sampled = turn.completion_end - turn.completion_start
            steps.append(
                {
                    "step": len(steps),
                    "segment": index,
                    "turn": turn.index,
                    "prompt_ids": tokens.prefix_ids(turn.completion_start),
                    "response_ids": trajectory.sampled_ids(turn.index),
                    "response_logprobs": trajectory.sampled_logprobs(turn.index),
                    "response_mask": np.ones(sampled, np.uint8),
                    "response_weight_versions": _token_versions(
                        (turn,), turn.completion_start, turn.completion_end
                    ),
                    "finish_reason": turn.finish_reason,
                    "sampling": None if turn.sampling is None else dict(turn.sampling),
                    "is_last": False,
                }
            )
    if steps:
        steps[-1]["is_last"] = True
    return {
        "schema_version": VIEWS_SCHEMA_VERSION,
        "session_id": session.id,
        "status": status,
        "metadata": session.metadata,
        "steps": steps,
    }


def serialize(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
