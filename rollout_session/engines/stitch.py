"""What every engine does the same way with a completion's pieces: the
policy-version spans a worker reports, and a continuation stitched onto the
partial completion it continues (`EngineRequest.continued`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import UpstreamMalformed
from ..tokens import IdArray, LogprobArray, VersionSpan
from .base import AgentReply, Completion, EngineRequest

__all__ = ["Stitched", "reported_spans", "stitch", "to_continue", "version_spans"]


def version_spans(
    reported: Sequence[Mapping[str, Any]] | None, version: str | None, n: int
) -> tuple[VersionSpan, ...]:
    """The versions of an answer's `n` sampled tokens: the spans the worker
    reported (SGLang's ``meta_info.weight_versions``, vLLM's
    ``weight_versions``), which must tile them in order, or else one span of
    the answer's `version`. Empty spans (SGLang reports ``[0, 0)`` for an
    answer with no tokens) are dropped; an answer with no tokens has none."""
    if not reported:
        return (VersionSpan(0, n, version),) if n else ()
    spans: list[VersionSpan] = []
    at = 0
    for raw in reported:
        start, end, label = raw.get("start"), raw.get("end"), raw.get("version")
        if (
            type(start) is not int
            or type(end) is not int
            or not isinstance(label, str)
            or start != at
            or end < start
        ):
            raise UpstreamMalformed(
                f"weight_versions do not tile the {n} output tokens in order",
                kind="weight_versions",
            )
        if end > start:
            spans.append(VersionSpan(start, end, label))
        at = end
    if at != n:
        raise UpstreamMalformed(
            f"weight_versions cover {at} of the {n} output tokens", kind="weight_versions"
        )
    return tuple(spans)


def reported_spans(spans: tuple[VersionSpan, ...]) -> list[dict[str, Any]]:
    """Spans in the shape the engines report them (the agent's reply's
    ``metadata.weight_versions``)."""
    return [{"version": v, "start": start, "end": end} for start, end, v in spans]


Stitched = tuple[IdArray, LogprobArray, tuple[VersionSpan, ...], "tuple[bytes, int] | None"]


def stitch(
    request: EngineRequest,
    ids: IdArray,
    logprobs: LogprobArray,
    spans: tuple[VersionSpan, ...],
    experts: tuple[bytes, int] | None,
) -> Stitched:
    """An answer to `request` as the turn's whole completion: itself when it
    continues nothing, else the partial's tokens, versions and routed
    experts followed by its own."""
    partial = request.partial
    if partial is None:
        return ids, logprobs, spans, experts
    done = len(partial.ids)
    whole_ids = np.concatenate([partial.ids, ids]).astype(np.int32)
    whole_logprobs = np.concatenate([partial.logprobs, logprobs]).astype(np.float32)
    shifted = tuple(VersionSpan(s.start + done, s.end + done, s.version) for s in spans)
    whole_experts = experts
    if partial.experts is not None and experts is not None:
        whole_experts = (partial.experts[0] + experts[0], experts[1])
    elif partial.experts is not None:
        whole_experts = partial.experts
    return whole_ids, whole_logprobs, partial.weight_versions + shifted, whole_experts


def to_continue(
    stitched: Stitched,
    *,
    cached_tokens: int | None,
    model: str | None,
    worker: str,
    latency_s: float,
    engine_state: Any,
    sampling: Mapping[str, Any] | None,
) -> Completion:
    """An aborted answer the turn runner will continue
    (`EngineRequest.aborts_continue`): what the continuation needs, with no
    parse and no reply (neither would be used)."""
    ids, logprobs, spans, experts = stitched
    return Completion(
        ids=ids,
        logprobs=logprobs,
        content=None,
        tool_calls=[],
        reasoning_content=None,
        finish_reason="abort",
        model=model,
        weight_versions=spans,
        cached_tokens=cached_tokens,
        experts=experts,
        worker=worker,
        latency_s=latency_s,
        reply=AgentReply(200, [], b""),
        engine_state=engine_state,
        sampling=sampling,
    )
