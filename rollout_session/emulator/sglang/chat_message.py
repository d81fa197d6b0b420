"""The message SGLang 0.5.23's chat route answers, under the worker's parsers.

Models ``srt/entrypoints/openai/serving_chat.py``
``OpenAIServingChat._build_chat_response`` (non-streaming; no chat encoder,
no response template: `names.unmodelled_parser` refuses those launches).
Its ``text`` is ``/generate``'s (decoded with the chat route's
``skip_special_tokens``: `chat_skips_special_tokens`), then:

- reasoning is split off only when the worker runs a reasoning parser and
  the request's ``separate_reasoning`` (default true) holds
  (``ReasoningParser.parse_non_stream``);
- tool calls are parsed only when ``_tool_call_parsing_active``: a tool-call
  parser, and ``tools`` with a ``tool_choice`` other than "none" (without
  ``tools``, only a detector whose ``parses_without_tools`` is true:
  minimax-m3); ``_process_tool_calls`` then reports the calls of offered
  functions (``parse_base_json`` drops the others), ids ``call_…``, or
  ``functions.NAME:IDX`` for kimi_k2 (``_process_tool_call_id``: IDX counts
  the request's earlier assistant tool calls), and turns finish "stop" into
  "tool_calls" (`answer.chat_response`);
- what no parser consumed stays in ``content`` (``text if text else ""``),
  ``reasoning_content`` is the reasoning when there is some (k2_horizon:
  also an empty one).

The emulator has no parsers: the parsed view of an answer is the sample's
message (`generation.Sample.message`: what the template's parsers find in
its text), the unparsed view its text, and the reasoning parser's rest of a
tool-call answer the text after ``</think>`` (`parse_memo.reasoning_rest`,
as ``/separate_reasoning`` answers it). A tool-call parser reading calls out
of an answer whose reasoning it was not given separately (the reasoning
block would stay in its normal text, detector by detector) is not modelled:
`ChatParsing.unmodelled` refuses it. The parsers are assumed to be the
template's (as on the parse routes, never checked).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rollout_session.emulator.model.generation import Sample
from rollout_session.emulator.sglang.parse_memo import reasoning_rest

__all__ = ["ChatParsing", "chat_skips_special_tokens"]

# Detectors whose `parses_without_tools` is true (function_call/minimax_m3.py;
# BaseFormatDetector's is false).
_PARSE_WITHOUT_TOOLS: Final = frozenset({"minimax-m3"})
# serving_chat._patch_reasoning_skip_special_tokens: reasoning parsers whose
# markers are special tokens keep them in the text (mistral: only with a
# reasoning_effort other than "none").
_KEEP_SPECIAL_REASONING: Final = frozenset({"apertus2509", "kimi_k3", "inkling", "muse"})


def chat_skips_special_tokens(
    body: Mapping[str, Any], tools: Sequence[Any], reasoning_parser: str | None
) -> bool:
    """The ``skip_special_tokens`` the chat route decodes with: the request's
    (default true), false when it offers tools with a ``tool_choice`` other
    than "none" (``_process_messages``) or the reasoning parser's markers are
    special (``_patch_reasoning_skip_special_tokens``). (gpt-oss and Gemma 4
    models, known by their config's ``model_type``, are not modelled: the
    emulator serves no model config.)"""
    if tools and body.get("tool_choice") != "none":
        return False
    if reasoning_parser in _KEEP_SPECIAL_REASONING:
        return False
    effort = body.get("reasoning_effort")
    if reasoning_parser == "mistral" and effort is not None and effort != "none":
        return False
    return body.get("skip_special_tokens") is not False


@dataclass(frozen=True)
class ChatParsing:
    """What the chat route's parsers do with one request's answer."""

    separate: bool  # the reasoning parser runs (parser and separate_reasoning)
    tool_calls: bool  # _tool_call_parsing_active
    offered: tuple[str, ...]  # the request's tools' function names
    # kimi_k2's ids: the request's earlier assistant tool calls; None: call_ ids.
    kimi_history: int | None = None
    empty_reasoning: bool = False  # k2_horizon reports "" reasoning

    @classmethod
    def of(
        cls,
        body: Mapping[str, Any],
        *,
        tool_call_parser: str | None,
        reasoning_parser: str | None,
        separate_reasoning: bool,
    ) -> ChatParsing:
        """The parsing of a checked chat request on a worker with these
        (resolved) parsers."""
        tools = body.get("tools") or ()
        offered = tuple(str(t["function"]["name"]) for t in tools)
        if not tool_call_parser:
            active = False
        elif not offered:
            active = tool_call_parser in _PARSE_WITHOUT_TOOLS
        else:
            active = body.get("tool_choice") != "none"
        history = None
        if tool_call_parser == "kimi_k2":
            history = sum(
                len(m.get("tool_calls") or ())
                for m in body.get("messages") or ()
                if isinstance(m, dict) and m.get("role") == "assistant"
            )
        separate = reasoning_parser is not None and separate_reasoning
        return cls(
            separate=separate,
            tool_calls=active,
            offered=offered,
            kimi_history=history,
            empty_reasoning=separate and reasoning_parser == "k2_horizon",
        )

    def unmodelled(self, sample: Sample) -> str | None:
        """Why the emulator cannot answer this sample as SGLang would, or None."""
        message = sample.message
        if (
            self.tool_calls
            and not self.separate
            and message.get("tool_calls")
            and message.get("reasoning_content")
        ):
            return (
                "the emulator does not model a tool-call parser reading an answer whose "
                "reasoning was not separated (launch with --reasoning-parser, and keep "
                "separate_reasoning true)"
            )
        return None

    def message(self, sample: Sample, text: Callable[[], str]) -> dict[str, Any]:
        """The answer's message; ``text()`` is its ``/generate`` text, decoded
        only when a part of it stays unparsed."""
        parsed = sample.message
        reasoning = parsed.get("reasoning_content") if self.separate else None
        calls = parsed.get("tool_calls") or None
        if not self.separate and not (calls and self.tool_calls):
            # No parser consumed anything: the text is the content.
            return {"role": "assistant", "content": text()}
        if calls and not self.tool_calls:
            # Only the reasoning parser ran: the calls stay in its rest.
            raw = text()
            content = reasoning_rest(raw, parsed) if reasoning else raw
            return self._message(content, reasoning, None)
        content = parsed.get("content") or ""
        if not calls:
            return self._message(content, reasoning, None)
        kept = [c for c in calls if c["function"]["name"] in self.offered]
        return self._message(content, reasoning, self._ids(kept) or None)

    def _message(
        self, content: str, reasoning: str | None, calls: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning or self.empty_reasoning:
            message["reasoning_content"] = reasoning or ""
        if calls:
            message["tool_calls"] = calls
        return message

    def _ids(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The reported calls, numbered in order (``index``), with SGLang's ids."""
        out = []
        for i, call in enumerate(calls):
            call = {**call, "index": i}
            if self.kimi_history is not None:
                call["id"] = f"functions.{call['function']['name']}:{self.kimi_history + i}"
            out.append(call)
        return out
