"""SGLang's detokenizer, for workers launched with ``--skip-tokenizer-init``.

Such a worker (verl launches SGLang this way) answers ``/generate`` with ids
and no text (SGLang 0.5.23 ``srt/managers/tokenizer_manager.py``
``_handle_batch_output``, the ``BatchTokenIDOutput`` branch; its
``output_token_logprobs`` carry no text either: ``return_text_in_logprobs
and not self.skip_tokenizer_init``). The parse routes and the agent's answer
need the text a worker with a tokenizer would have answered, so it is
decoded here exactly as SGLang's detokenizer decodes it
(``srt/managers/detokenizer_manager.py``), not by one plain decode:

- The scheduler hands a non-streamed request's ids to the detokenizer every
  ``SGLANG_FORCE_STREAM_INTERVAL`` (50) output tokens and once finished
  (``scheduler_components/output_streamer.py`` ``OutputStreamer.accept``).
- Each hand-off decodes from a surrogate offset: the first one starts with
  the last 5 prompt ids as context (``schedule_batch.py``
  ``Req.init_incremental_detokenize``, ``INIT_INCREMENTAL_DETOKENIZATION_OFFSET``),
  and the new text is ``decode(ids[surr:]) - decode(ids[surr:read])``
  (``DetokenizerManager._decode_batch_token_id_output``). Text that ends
  in an incomplete character (``"�"``) is not committed: the next hand-off
  decodes it again with more ids.
- When finished, the matched stop token is dropped from the ids decoded
  (``trim_matched_stop``; gpt-oss's tool-call token 200012 is kept under
  the gpt-oss tool parser), and a matched stop string cuts the text not
  yet emitted (what earlier hand-offs emitted stays).
- ``skip_special_tokens`` and ``spaces_between_special_tokens`` are the
  request's, passed to the tokenizer's ``decode`` as SGLang passes them.

Each sampled token's text (the agent's ``logprobs``) is its id decoded
alone, as ``TokenizerManager.detokenize_logprob_tokens`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["FORCE_STREAM_INTERVAL", "Detokenizer"]

# SGLang's SGLANG_FORCE_STREAM_INTERVAL default (srt/environ.py): a worker
# whose environment sets another decodes at other boundaries (docs/engines.md
# says so).
FORCE_STREAM_INTERVAL = 50
# Req.init_incremental_detokenize's prompt context (schedule_batch.py).
_PROMPT_CONTEXT = 5
# gpt-oss's <|call|>: kept when it ends an answer under the gpt-oss tool parser.
_GPT_OSS_CALL = 200012


class Decoder(Protocol):
    """What of a HF tokenizer the detokenizer uses."""

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


class Detokenizer:
    def __init__(self, tokenizer: Decoder, tool_call_parser: str | None) -> None:
        if tool_call_parser == "response_template":
            # Its stop-token closers come from the parser's detector
            # (parser/response_template.py tool_close_tokens): not reproduced.
            raise ValueError(
                "--tool-call-parser response_template on a --skip-tokenizer-init worker: "
                "its detokenizer rules are not reproduced here"
            )
        self._tokenizer = tokenizer
        self._keeps_call = tool_call_parser == "gpt-oss"

    def _decode(self, ids: Sequence[int], skip: bool, spaces: bool) -> str:
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=skip, spaces_between_special_tokens=spaces
        )

    def _trim_ids(self, ids: list[int], finish: Mapping[str, Any]) -> list[int]:
        matched = finish.get("matched")
        if not isinstance(matched, int) or isinstance(matched, bool) or not ids:
            return ids
        if self._keeps_call and ids[-1] == _GPT_OSS_CALL:
            return ids
        return ids[:-1]  # the last id is the matched stop token

    @staticmethod
    def _trim_text(text: str, finish: Mapping[str, Any]) -> str:
        matched = finish.get("matched")
        if not isinstance(matched, str):
            return text
        position = text.find(matched)
        return text if position < 0 else text[:position]

    def text(
        self,
        prompt: Sequence[int],
        output: Sequence[int],
        finish: Mapping[str, Any],
        *,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> str:
        """The text SGLang answers for `output` sampled after `prompt`, the
        request finished as `finish` (``meta_info.finish_reason``): what the
        detokenizer emits at each hand-off, joined as the tokenizer manager
        joins it (``ReqState.append_text``). Its state is
        ``DetokenizerManager``'s ``DecodeStatus``, step for step: a stop
        string found in text already emitted cuts nothing of it."""
        skip, spaces = skip_special_tokens, spaces_between_special_tokens
        context = [int(i) for i in prompt[-_PROMPT_CONTEXT:]]
        ids = context + [int(i) for i in output]
        surr, read = 0, len(context)
        decoded = ""  # DecodeStatus.decoded_text: committed
        sent = 0  # DecodeStatus.sent_offset: emitted, maybe past what is committed
        emitted: list[str] = []
        stops = range(FORCE_STREAM_INTERVAL, len(output), FORCE_STREAM_INTERVAL)
        for upto in [*stops, len(output)]:
            done = upto == len(output)
            now = ids[: len(context) + upto]
            read_ids = self._trim_ids(now[surr:], finish) if done else now[surr:]
            surr_text = self._decode(now[surr:read], skip, spaces)
            new = self._decode(read_ids, skip, spaces)[len(surr_text) :]
            if done:
                emitted.append(self._trim_text(decoded + new, finish)[sent:])
                break
            pending = sent - len(decoded)
            if new and not new.endswith("\ufffd"):
                decoded += new
                surr, read = read, len(now)
                sent = len(decoded)
                emitted.append(new[pending:])
            else:
                # An incomplete character: its printable prefix goes out, the
                # offsets stay, and the next hand-off decodes it again.
                printable = _printable(new)
                sent = len(decoded) + len(printable)
                emitted.append(printable[pending:])
        return "".join(emitted)

    def token_texts(self, ids: Sequence[int]) -> list[str | None]:
        """Each id decoded alone (``detokenize_logprob_tokens``)."""
        return [self._tokenizer.decode([token]) for token in ids]


def _is_cjk(code: int) -> bool:
    """SGLang's ``_is_chinese_char`` (``sglang/utils.py``): the CJK blocks."""
    return (
        0x4E00 <= code <= 0x9FFF
        or 0x3400 <= code <= 0x4DBF
        or 0x20000 <= code <= 0x2A6DF
        or 0x2A700 <= code <= 0x2B73F
        or 0x2B740 <= code <= 0x2B81F
        or 0x2B820 <= code <= 0x2CEAF
        or 0xF900 <= code <= 0xFAFF
        or 0x2F800 <= code <= 0x2FA1F
    )


def _printable(text: str) -> str:
    """SGLang's ``find_printable_text`` (``sglang/utils.py``): the longest
    prefix of whole words (through a newline, a CJK character, or the last
    space)."""
    if text.endswith("\n"):
        return text
    if text and _is_cjk(ord(text[-1])):
        return text
    if len(text) > 1 and _is_cjk(ord(text[-2])):
        return text[:-1]
    return text[: text.rfind(" ") + 1]
