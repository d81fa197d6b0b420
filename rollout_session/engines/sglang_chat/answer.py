"""Strict validation of SGLang's ``/v1/chat/completions`` 200 answer (docs/api.md#answer).

A typed decoder built from the engines' shared pieces (`engines.answer`)
reads only the fields we need (SGLang 0.5.23's ``ChatCompletionResponse``
with ``meta_info``); what msgspec cannot express (length agreement, prompt
token count) is checked here after decoding. Anything that fails is
`UpstreamMalformed`: nothing of that turn is committed.

Decoding is CPU-bound and holds the GIL, so the server runs `check_answer`
for large bodies in a worker process: everything here is picklable (the
arguments, `WorkerAnswer`, the error) and nothing touches session state.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from ...errors import UpstreamMalformed
from ...tokens import IdArray, LogprobArray
from ..answer import AnswerCheck, Logprob, decode_routed_experts, token_id

__all__ = [
    "WorkerAnswer",
    "answer_decoder",
    "check_answer",
    "decode_cost",
    "parse_worker_answer",
]


class _Function(msgspec.Struct):
    name: str
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(msgspec.Struct):
    function: _Function
    id: str | None = None


class _Message(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None
    reasoning_content: str | None = None


class _FinishReason(msgspec.Struct):
    type: str


def _structs(vocab_size: int) -> type[msgspec.Struct]:
    """Build the answer type for one vocabulary (the id bound is part of it)."""
    TokenId = token_id(vocab_size)

    # array_like: an entry is [logprob, id, text?]; only the two fields we use
    # are decoded, trailing elements are skipped
    # (docs/performance.md#decode-only-what-is-used). gc=False: an entry holds
    # only a float and an int, so the collector never needs to track them.
    Entry = msgspec.defstruct(
        "Entry", [("logprob", Logprob), ("token_id", TokenId)], array_like=True, gc=False
    )
    MetaInfo = msgspec.defstruct(
        "MetaInfo",
        [
            ("output_token_logprobs", list[Entry]),  # type: ignore[valid-type]
            ("completion_tokens", int),
            ("prompt_tokens", int | None, None),
            ("cached_tokens", int | None, None),
            ("finish_reason", _FinishReason | None, None),
            ("weight_version", str | None, None),
            # Set when the answer spans a version change (SGLang 0.5.23:
            # utils/weight_versions.add_weight_versions_to_meta_info).
            ("weight_versions", list[dict[str, Any]] | None, None),
            ("routed_experts", str | None, None),
        ],
    )
    Choice = msgspec.defstruct(
        "Choice",
        [
            ("message", _Message),
            ("finish_reason", str | None, None),
            ("meta_info", MetaInfo | None, None),
        ],
    )
    return msgspec.defstruct(
        "Answer",
        [
            ("choices", Annotated[list[Choice], msgspec.Meta(min_length=1)]),  # type: ignore[valid-type]
            ("meta_info", MetaInfo | None, None),
            ("model", str | None, None),
        ],
    )


@functools.cache
def answer_decoder(vocab_size: int) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(_structs(vocab_size))


@dataclass(slots=True, frozen=True)
class WorkerAnswer:
    """What a validated answer contributes to the trajectory and history."""

    ids: IdArray
    logprobs: LogprobArray
    content: str | None
    tool_calls: list[dict[str, Any]]
    reasoning_content: str | None
    finish_reason: str | None
    cached_tokens: int | None
    weight_version: str | None
    model: str | None
    # Base64 routed-expert ids for the positions asked for (R3), unparsed.
    routed_experts: str | None = None
    weight_versions: list[dict[str, Any]] | None = None  # SGLang's spans, if sent


_EXPERTS_KEY = b'"routed_experts":"'


def decode_cost(body: bytes, *, experts: bool) -> int:
    """The bytes of `body` that cost decode time: all but the routed-experts
    string, which is looked for only when `experts` were asked for.

    Decoding costs per JSON value, not per byte: the logprob entries cost
    far more than a long base64 string of the same size. Where an answer is
    validated (loop or process) is decided on this; a miss (other spacing,
    or experts not asked for) only counts the string in. Not looking saves
    a scan of the body on the loop.
    """
    if not experts:
        return len(body)
    start = body.find(_EXPERTS_KEY)
    if start < 0:
        return len(body)
    end = body.find(b'"', start + len(_EXPERTS_KEY))
    return len(body) - (end - start) if end > 0 else len(body)


_PATH = re.compile(r"at `\$([^`]*)`")


def _kind(message: str) -> str:
    """Coarse failure class for logs and metrics, from msgspec's error path."""
    match = _PATH.search(message)
    path = match.group(1) if match else ""
    if path.endswith("][0]") and "output_token_logprobs" in path:
        return "logprob"
    if path.endswith("][1]") and "output_token_logprobs" in path:
        return "token_id"
    return path.rsplit(".", 1)[-1].split("[", 1)[0] or "schema"


def parse_worker_answer(body: bytes, *, sent_prompt_tokens: int, vocab_size: int) -> WorkerAnswer:
    """Decode and check a worker's 200 body; raise `UpstreamMalformed` if bad."""
    try:
        answer = answer_decoder(vocab_size).decode(body)
    except msgspec.ValidationError as exc:
        raise UpstreamMalformed(
            f"worker answer failed validation: {exc}", kind=_kind(str(exc))
        ) from None
    except msgspec.DecodeError as exc:
        raise UpstreamMalformed(f"worker answer is not valid JSON: {exc}", kind="json") from None
    choice = answer.choices[0]
    meta = choice.meta_info or answer.meta_info
    if meta is None:
        raise UpstreamMalformed("worker answer has no meta_info", kind="meta_info_missing")
    entries = meta.output_token_logprobs
    if len(entries) != meta.completion_tokens:
        raise UpstreamMalformed(
            f"worker sent {len(entries)} output_token_logprobs for "
            f"completion_tokens={meta.completion_tokens}",
            kind="length_mismatch",
        )
    if meta.prompt_tokens is not None and meta.prompt_tokens != sent_prompt_tokens:
        raise UpstreamMalformed(
            f"worker reports prompt_tokens={meta.prompt_tokens} but was sent "
            f"{sent_prompt_tokens} input_ids",
            kind="prompt_tokens_mismatch",
        )
    ids = np.fromiter((e.token_id for e in entries), np.int32, len(entries))
    logprobs = np.fromiter((e.logprob for e in entries), np.float32, len(entries))
    # Sampled logprobs are ≤ 0; epsilon-positive noise is clamped so the
    # stored value is a valid log-probability.
    np.minimum(logprobs, 0.0, out=logprobs)
    message = choice.message
    finish = choice.finish_reason or (meta.finish_reason.type if meta.finish_reason else None)
    return WorkerAnswer(
        ids=ids,
        logprobs=logprobs,
        content=message.content,
        tool_calls=[
            {"id": c.id, "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls or []
        ],
        reasoning_content=message.reasoning_content,
        finish_reason=finish,
        cached_tokens=meta.cached_tokens,
        weight_version=meta.weight_version,
        model=answer.model,
        routed_experts=meta.routed_experts,
        weight_versions=meta.weight_versions,
    )


def check_answer(body: bytes, check: AnswerCheck) -> tuple[WorkerAnswer, tuple[bytes, int] | None]:
    """`parse_worker_answer` plus the routed-experts check, in one call that
    can run in a worker process. The base64 blob is not returned: the decoded
    bytes are what the trajectory stores."""
    answer = parse_worker_answer(
        body, sent_prompt_tokens=check.sent_prompt_tokens, vocab_size=check.vocab_size
    )
    if check.experts_from is None:
        return answer, None
    experts = decode_routed_experts(
        answer.routed_experts,
        positions=check.sent_prompt_tokens + len(answer.ids) - 1 - check.experts_from,
        width=check.experts_width,
    )
    return dataclasses.replace(answer, routed_experts=None), experts
