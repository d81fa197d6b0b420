"""Export documents (schema 3) built by hand, for the adapter's unit tests:
segments whose turns tile them as the server's do (docs/training.md)."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout_session.trainers import Episode

__all__ = ["Turn", "document", "episode", "segment"]

# (appended ids, sampled ids, finish reason, version spans as (length, label), continuations)
Turn = tuple[list[int], list[int], str, Sequence[tuple[int, str]], int]


def segment(
    index: int,
    turns: Sequence[Turn],
    *,
    routes: tuple[int, int] | None = None,
    branch: str | None = None,
) -> dict[str, Any]:
    """A segment of `turns`; `routes`: (layers, top_k) for a routed-experts
    blob over every position but the last (position p, layer l, slot k
    routes to expert ``(p * 7 + l * 3 + k) % 64``)."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    records = []
    for i, (appended, sampled, finish, spans, continuations) in enumerate(turns):
        prompt_start = len(ids)
        ids += appended
        mask += [0] * len(appended)
        logprobs += [0.0] * len(appended)
        start = len(ids)
        ids += sampled
        mask += [1] * len(sampled)
        logprobs += [-0.5 - 0.01 * t for t in range(len(sampled))]
        at = start
        versions = []
        for length, label in spans:
            versions.append({"start": at, "end": at + length, "version": label})
            at += length
        assert at == len(ids), "spans must tile the sampled ids"
        records.append(
            {
                "index": i,
                "prompt_start": prompt_start,
                "completion_start": start,
                "completion_end": len(ids),
                "finish_reason": finish,
                "weight_versions": versions,
                "continuations": [{"start": start}] * continuations,
            }
        )
    doc: dict[str, Any] = {
        "index": index,
        "branch": None if branch is None else {"reason": branch, "segment": index - 1},
        "token_ids": ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "prompt_length": records[0]["completion_start"] if records else len(ids),
        "turns": records,
    }
    if routes is not None:
        layers, top_k = routes
        positions = len(ids) - 1
        values = np.fromfunction(
            lambda p, layer, k: (p * 7 + layer * 3 + k) % 64,
            (positions, layers, top_k),
            dtype=np.int32,
        ).astype(np.int32)
        doc["routed_experts"] = {
            "dtype": "int32",
            "shape": [positions, layers * top_k],
            "data": base64.b64encode(values.tobytes()).decode(),
        }
    return doc


def document(*segments: dict[str, Any], session_id: str = "s1") -> dict[str, Any]:
    return {
        "schema_version": 3,
        "session_id": session_id,
        "status": "closed",
        "segments": list(segments),
        "num_segments": len(segments),
        "rollbacks": [],
    }


def episode(
    *segments: dict[str, Any], reward: float | None = 1.0, session_id: str = "s1"
) -> Episode:
    return Episode(session_id, document(*segments, session_id=session_id), reward)
