"""Strict validation of a worker's ``/generate`` answer (docs/api.md#answer).

SGLang 0.5.23's answer to one non-streamed request is ``{"text",
"output_ids", "meta_info"}`` (tokenizer_manager ``_handle_batch_output``):
``output_ids`` through the stop token, ``meta_info.output_token_logprobs``
one ``[logprob, id, text]`` per output id. A typed msgspec decoder refuses
what cannot be a sample (non-finite or positive logprobs, ids outside the
vocabulary, bool-as-int); lengths and the prompt count are checked after.
Everything here is picklable: it may run in a worker process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ...errors import UpstreamMalformed
from ...tokens import IdArray, LogprobArray
from ..answer import AnswerCheck, Logprob, decode_routed_experts, decode_strictly, token_id

__all__ = ["GenerateAnswer", "check_generate_answer", "check_generate_ids"]


class _Finish(msgspec.Struct):
    type: str
    matched: int | str | None = None


def _structs(vocab_size: int) -> type[msgspec.Struct]:
    TokenId = token_id(vocab_size)
    Entry = msgspec.defstruct(
        "Entry",
        [("logprob", Logprob), ("token_id", TokenId), ("text", str | None, None)],
        array_like=True,
        gc=False,
    )
    Meta = msgspec.defstruct(
        "GenerateMeta",
        [
            ("output_token_logprobs", list[Entry]),  # type: ignore[valid-type]
            ("completion_tokens", int),
            ("finish_reason", _Finish),
            # Absent only from a request aborted in the waiting queue
            # (tokenizer_manager._handle_abort_req): checked below.
            ("prompt_tokens", int | None, None),
            ("cached_tokens", int | None, None),
            ("reasoning_tokens", int | None, None),
            ("weight_version", str | None, None),
            ("weight_versions", list[dict[str, Any]] | None, None),
            ("routed_experts", str | None, None),
        ],
    )
    return msgspec.defstruct(
        "GenerateAnswer",
        [
            ("output_ids", list[TokenId]),  # type: ignore[valid-type]
            ("meta_info", Meta),
            # Absent from a --skip-tokenizer-init worker's answer (checked below).
            ("text", str | None, None),
        ],
    )


@functools.cache
def _decoder(vocab_size: int) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(_structs(vocab_size))


class _RawMeta(msgspec.Struct):
    meta_info: msgspec.Raw


# The worker's meta_info as it sent it, for the agent's answer (the chat
# route passes it through whole): kept as JSON text, never rebuilt.
_RAW_META = msgspec.json.Decoder(_RawMeta)


@dataclass(slots=True, frozen=True)
class GenerateAnswer:
    ids: IdArray
    logprobs: LogprobArray
    token_texts: list[str | None]  # each sampled token's text, as the worker decoded it
    text: str  # the answer's text (stop token trimmed as SGLang trims it)
    finish: dict[str, Any]  # SGLang's finish_reason: type, matched
    prompt_tokens: int
    cached_tokens: int | None
    reasoning_tokens: int | None
    weight_version: str | None
    experts: tuple[bytes, int] | None
    weight_versions: list[dict[str, Any]] | None = None  # SGLang's version spans, if sent
    meta_json: bytes = b"{}"  # meta_info, as the worker serialised it


def check_generate_answer(body: bytes, check: AnswerCheck) -> GenerateAnswer:
    """Decode and check a ``/generate`` 200 body; raise `UpstreamMalformed` if bad."""
    return _checked(body, check, ids_only=False)


def check_generate_ids(body: bytes, check: AnswerCheck) -> GenerateAnswer:
    """`check_generate_answer` for a ``--skip-tokenizer-init`` worker, which
    answers ids and no text: the answer's `text` is "" and its `token_texts`
    None until the engine decodes them (`detokenize.Detokenizer`)."""
    return _checked(body, check, ids_only=True)


def _checked(body: bytes, check: AnswerCheck, *, ids_only: bool) -> GenerateAnswer:
    answer = decode_strictly(_decoder(check.vocab_size), body)
    if (answer.text is None) is not ids_only:
        raise UpstreamMalformed(
            "worker answer has text although its /server_info says --skip-tokenizer-init"
            if ids_only
            else "worker answer has no text (a --skip-tokenizer-init worker, which its "
            "/server_info does not say)",
            kind="schema",
        )
    meta = answer.meta_info
    entries = meta.output_token_logprobs
    if not (len(entries) == len(answer.output_ids) == meta.completion_tokens):
        raise UpstreamMalformed(
            f"worker sent {len(entries)} output_token_logprobs and {len(answer.output_ids)} "
            f"output_ids for completion_tokens={meta.completion_tokens}",
            kind="length_mismatch",
        )
    prompt_tokens = meta.prompt_tokens
    if prompt_tokens is None and meta.finish_reason.type == "abort":
        prompt_tokens = check.sent_prompt_tokens
    if prompt_tokens != check.sent_prompt_tokens:
        raise UpstreamMalformed(
            f"worker reports prompt_tokens={meta.prompt_tokens} but was sent "
            f"{check.sent_prompt_tokens} input_ids",
            kind="prompt_tokens_mismatch",
        )
    ids = np.fromiter((e.token_id for e in entries), np.int32, len(entries))
    if ids.tolist() != answer.output_ids:
        raise UpstreamMalformed(
            "output_token_logprobs name other tokens than output_ids", kind="token_id"
        )
    logprobs = np.fromiter((e.logprob for e in entries), np.float32, len(entries))
    np.minimum(logprobs, 0.0, out=logprobs)
    experts = None
    if check.experts_from is not None:
        experts = decode_routed_experts(
            meta.routed_experts,
            positions=check.sent_prompt_tokens + len(ids) - 1 - check.experts_from,
            width=check.experts_width,
        )
    return GenerateAnswer(
        ids=ids,
        logprobs=logprobs,
        token_texts=[e.text for e in entries],
        text=answer.text or "",
        finish={"type": meta.finish_reason.type, "matched": meta.finish_reason.matched},
        prompt_tokens=prompt_tokens,
        cached_tokens=meta.cached_tokens,
        reasoning_tokens=meta.reasoning_tokens,
        weight_version=meta.weight_version,
        weight_versions=meta.weight_versions,
        experts=experts,
        meta_json=bytes(_RAW_META.decode(body).meta_info),
    )
