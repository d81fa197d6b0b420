"""SGLang's ``/parse_function_call`` and ``/separate_reasoning``, from memory.

SGLang 0.5.23 (``srt/entrypoints/http_server.py`` ``parse_function_call_request``
and ``separate_reasoning_request``) runs its tool-call parser
(``srt/function_call/function_call_parser.py`` ``FunctionCallParser.parse_non_stream``)
or reasoning parser (``srt/parser/reasoning_parser.py`` ``ReasoningParser.parse_non_stream``)
over any text. The emulator has no parsers: it remembers what it sampled.
Every sample, on either route, is noted with its parsed message (content,
reasoning, tool calls: `generation.Sample.message`), and the texts
``/generate`` would answer for it (decoded with and without special tokens,
the stop token trimmed) are the keys under which that message is found,
together with the text ``/separate_reasoning`` leaves after the reasoning
(so the reasoning-then-tools pipeline of a client works). Text the emulator
did not sample is refused with a 400, never guessed at.

The memo is bounded (entries and characters, least recently used first
out); samples are decoded into it only when a parse route is first asked
after them, so serving without parse calls costs nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from rollout_session.emulator.faults import Reply, error_body
from rollout_session.emulator.sglang.names import REASONING_PARSERS, TOOL_CALL_PARSERS

__all__ = ["NOT_SAMPLED", "ParseMemo", "Parsed", "reasoning_rest"]

# srt/entrypoints/openai/chat_encoding_adapters.py ADAPTER_OUTPUT_PARSERS: parsed
# by the served model's adapter, which the emulator never serves.
_ADAPTER_PARSERS: Final = frozenset({"deepseek-v4", "deepseekv4", "deepseek-v41", "deepseekv41"})
NOT_SAMPLED: Final = "the emulator parses only text it sampled"
# Reasoning parsers whose detector parses with BaseReasoningFormatDetector's
# `_detect_and_parse_impl` and no self label, by their think-start token:
# when reasoning, the detector strips every leading think-start token first,
# so a client may prefix one to the text to force reasoning (serving_chat
# forces it; /separate_reasoning cannot be told to).
_THINK_STARTS: Final[Mapping[str, str]] = {
    **dict.fromkeys(
        (
            "deepseek-r1", "step3", "step3p5", "gigachat35", "iquest_q1", "qwen3",
            "qwen3-thinking", "minimax", "nanbeige", "interns1", "dots", "deepseek-v3", "mimo",
            "poolside_v1", "kimi_k2", "glm45", "ling3", "nemotron_3",
        ),
        "<think>",
    ),
    "mistral": "[THINK]",
}  # fmt: skip
_THINK_END: Final = "</think>"


@dataclass(frozen=True)
class Parsed:
    """What SGLang's parsers make of one text."""

    reasoning_text: str  # /separate_reasoning: "" when there is none
    text: str  # /separate_reasoning: the rest
    normal_text: str  # /parse_function_call: the text beside the calls
    calls: tuple[tuple[str, str], ...]  # /parse_function_call: (name, arguments JSON)

    @property
    def weight(self) -> int:
        return (
            len(self.reasoning_text)
            + len(self.text)
            + len(self.normal_text)
            + sum(len(n) + len(a) for n, a in self.calls)
        )


def reasoning_rest(text: str, message: Mapping[str, Any]) -> str:
    """What /separate_reasoning leaves of `text`: the content of a text
    answer; of a tool-call answer, the text after its reasoning (and the
    ``</think>`` closing it), whitespace-stripped on the left, or all of it."""
    if not message.get("tool_calls"):
        content: str = message.get("content") or ""
        return content
    reasoning = message.get("reasoning_content")
    at = text.find(reasoning) if isinstance(reasoning, str) and reasoning else -1
    if at < 0 or not isinstance(reasoning, str):
        return text
    rest = text[at + len(reasoning) :]
    if _THINK_END in rest:
        rest = rest.split(_THINK_END, 1)[1]
    return rest.lstrip()


class ParseMemo:
    """Sampled texts → their parse; bounded, least recently used out."""

    def __init__(
        self,
        decode: Callable[[Sequence[int], bool], str],
        *,
        entries: int = 4096,
        chars: int = 1 << 26,
        pending_tokens: int = 1 << 22,
    ) -> None:
        self._decode = decode  # (ids, skip_special_tokens) -> text
        self._entries = entries
        self._chars = chars
        self._pending_tokens_limit = pending_tokens
        self._pending: deque[tuple[list[int], Mapping[str, Any]]] = deque()
        self._pending_tokens = 0
        self._parsed: OrderedDict[str, Parsed] = OrderedDict()
        self._weight = 0

    def __len__(self) -> int:
        self._index()
        return len(self._parsed)

    def note(self, text_ids: list[int], message: Mapping[str, Any]) -> None:
        """Remember a sample: `text_ids` are the ids its ``text`` decodes
        (the stop token trimmed), `message` its parsed message."""
        self._pending.append((text_ids, message))
        self._pending_tokens += len(text_ids)
        while self._pending and (
            len(self._pending) > self._entries or self._pending_tokens > self._pending_tokens_limit
        ):
            dropped, _ = self._pending.popleft()
            self._pending_tokens -= len(dropped)

    def lookup(self, text: str) -> Parsed | None:
        self._index()
        parsed = self._parsed.get(text)
        if parsed is not None:
            self._parsed.move_to_end(text)
        return parsed

    def _index(self) -> None:
        while self._pending:
            ids, message = self._pending.popleft()
            self._pending_tokens -= len(ids)
            calls = tuple(
                (str(c["function"]["name"]), str(c["function"]["arguments"]))
                for c in message.get("tool_calls") or ()
            )
            content = message.get("content") or ""
            reasoning = message.get("reasoning_content") or ""
            for skip in (False, True):
                text = self._decode(ids, skip)
                rest = reasoning_rest(text, message)
                self._put(rest, Parsed("", rest, content, calls))
                self._put(text, Parsed(reasoning, rest, content, calls))

    def _put(self, key: str, parsed: Parsed) -> None:
        old = self._parsed.pop(key, None)
        if old is not None:
            self._weight -= len(key) + old.weight
        self._parsed[key] = parsed
        self._weight += len(key) + parsed.weight
        while len(self._parsed) > self._entries or self._weight > self._chars:
            gone_key, gone = self._parsed.popitem(last=False)
            self._weight -= len(gone_key) + gone.weight

    # -- the routes ----------------------------------------------------------

    def parse_function_call(self, raw: bytes) -> Reply:
        """``/parse_function_call {text, tools, tool_call_parser}``."""
        body = _body(raw)
        if isinstance(body, Reply):
            return body
        invalid = _check_text(body) or _check_tools(body.get("tools"))
        parser = body.get("tool_call_parser")
        if invalid is None and parser is not None and not isinstance(parser, str):
            invalid = "tool_call_parser: Input should be a valid string"
        if invalid is not None:
            return _validation_error(invalid)
        if parser in _ADAPTER_PARSERS:
            return _not_served(str(parser))
        if parser not in TOOL_CALL_PARSERS:
            return _internal_error(f"Unsupported tool_call_parser: {parser}")
        parsed = self.lookup(body["text"])
        if parsed is None:
            return _refused()
        offered = [t["function"]["name"] for t in body.get("tools") or ()]
        calls = []
        for ordinal, (name, arguments) in enumerate(parsed.calls):
            if name not in offered:
                # parse_base_json: a call of a function not in `tools` is
                # dropped (SGLANG_FORWARD_UNKNOWN_TOOLS is off by default).
                continue
            # Kimi K2's detector numbers calls; the JSON detectors give the
            # tool's position in `tools`.
            index = ordinal if parser == "kimi_k2" else offered.index(name)
            calls.append({"tool_index": index, "name": name, "parameters": arguments})
        return _ok({"normal_text": parsed.normal_text, "calls": calls})

    def separate_reasoning(self, raw: bytes) -> Reply:
        """``/separate_reasoning {text, reasoning_parser, return_blocks}``."""
        body = _body(raw)
        if isinstance(body, Reply):
            return body
        parser = body.get("reasoning_parser")
        invalid = _check_text(body)
        if invalid is None and not isinstance(parser, str):
            problem = "Field required" if parser is None else "Input should be a valid string"
            invalid = f"reasoning_parser: {problem}"
        blocks = body.get("return_blocks", False)
        if invalid is None and not isinstance(blocks, bool):
            invalid = "return_blocks: Input should be a valid boolean"
        if invalid is not None:
            return _validation_error(invalid)
        assert isinstance(parser, str)
        if parser in _ADAPTER_PARSERS:
            return _not_served(parser)
        if not parser:
            return _internal_error("Model type must be specified")
        if parser.lower() not in REASONING_PARSERS:
            return _internal_error(f"Unsupported model type: {parser}")
        text: str = body["text"]
        parsed = self.lookup(text)
        start = _THINK_STARTS.get(parser.lower())
        while parsed is None and start and text.startswith(start):
            text = text[len(start) :]
            parsed = self.lookup(text)
        if parsed is None:
            return _refused()
        answer: dict[str, Any] = {"reasoning_text": parsed.reasoning_text, "text": parsed.text}
        if blocks:
            # ReasoningParser.parse_non_stream_blocks: the reasoning (if any), then the text.
            seq = [("reasoning", parsed.reasoning_text)] if parsed.reasoning_text else []
            seq.append(("text", parsed.text))
            answer["reasoning_blocks"] = [t for k, t in seq if k == "reasoning"]
            answer["text_blocks"] = [t for k, t in seq if k == "text"]
            answer["blocks"] = [{"type": k, "text": t} for k, t in seq]
        return _ok(answer)


def _body(raw: bytes) -> dict[str, Any] | Reply:
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _validation_error("body: JSON decode error")
    if not isinstance(body, dict):
        return _validation_error("body: Input should be a valid dictionary")
    return body


def _check_text(body: Mapping[str, Any]) -> str | None:
    if "text" not in body:
        return "text: Field required"
    if not isinstance(body["text"], str):
        return "text: Input should be a valid string"
    return None


def _check_tools(tools: Any) -> str | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        return "tools: Input should be a valid list"
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            return f"tools.{i}.function.name: Field required (a string)"
    return None


def _ok(payload: dict[str, Any]) -> Reply:
    return Reply(200, orjson.dumps(payload))


def _validation_error(message: str) -> Reply:
    """FastAPI's request validation error as SGLang renders it (flat, 400)."""
    return Reply(400, error_body(message, type_="Bad Request"))


def _not_served(parser: str) -> Reply:
    """``native_text_parser``'s ValueError, raised as HTTPException(400)."""
    message = (
        f"{parser!r} output is parsed with its model's tokenizer; "
        "this server does not serve that model"
    )
    return Reply(400, error_body(message, type_="400"))


def _internal_error(message: str) -> Reply:
    """An uncaught ValueError: Starlette's plain-text 500 (the message is only
    in SGLang's log; the emulator puts it in a header)."""
    return Reply(
        500,
        b"Internal Server Error",
        {"x-emulator-error": message},
        content_type="text/plain; charset=utf-8",
    )


def _refused() -> Reply:
    return Reply(400, orjson.dumps({"error": {"message": NOT_SAMPLED}}))
