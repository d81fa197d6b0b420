"""Tokenizer and chat template: turning messages into the ids the model reads.

Token-in/token-out (DESIGN §5). The first turn renders the chat template over
the whole request. Later turns never re-render history: the appended messages
are rendered after a fixed synthetic context that ends with an assistant turn
whose content is a sentinel, and only the text after that turn's end is
tokenised. So the cost is O(new tokens), and templates that rewrite history
(Qwen3 strips earlier ``<think>`` blocks) cannot change stored ids.

The same synthetic rendering gives the template's end-of-assistant-turn text
(e.g. ``<|im_end|>\\n``). A sampled completion usually ends inside it (it ends
with the EOS token, not the newline after it) or lacks it entirely
(``finish_reason=length``); `missing_turn_end` returns what the template would
have put there, appended with mask 0 before the next turn's tokens. That text
depends only on the tools and template kwargs, so it is rendered once per
distinct pair and kept (a bounded cache per tokenizer): a later turn renders
the template once, not twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import orjson

from .errors import InvalidRequest, InvariantViolated
from .messages import Message
from .trajectory import IdArray

__all__ = ["ChatTokenizer", "load_tokenizer", "missing_turn_end"]

_SENTINEL: Final = "\u2063⟦rollout-session:assistant-turn⟧\u2063"
_CONTEXT: Final[tuple[Message, ...]] = (
    {"role": "user", "content": "."},
    {"role": "assistant", "content": _SENTINEL, "tool_calls": []},
)
# Distinct (tools, kwargs) pairs whose end-of-turn text is kept; a server sees
# a handful (one tool set per agent type), the bound only stops a hostile mix.
_TURN_END_CACHE_SIZE: Final = 256


class ChatTokenizer:
    """An HF tokenizer plus the chat template the server renders with."""

    def __init__(self, hf_tokenizer: Any, chat_template: str | None = None) -> None:
        self._tok = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        self.chat_template: str | None = chat_template or getattr(
            hf_tokenizer, "chat_template", None
        )
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template; pass --chat-template")
        # Ids are valid in 0 ≤ id < vocab_size, added tokens included.
        self.vocab_size: int = max(hf_tokenizer.get_vocab().values()) + 1
        self.name_or_path: str = str(getattr(hf_tokenizer, "name_or_path", ""))
        # (tools, kwargs) as JSON -> (end-of-turn text, its ids).
        self._turn_ends: dict[bytes, tuple[str, tuple[int, ...]]] = {}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids

    def decode_pieces(self, ids: Sequence[int] | IdArray) -> list[str]:
        """Each token decoded on its own, special tokens kept (for inspection).
        A token holding part of a multi-byte character decodes to U+FFFD."""
        pieces: list[str] = self._backend.decode_batch(
            [[int(i)] for i in ids], skip_special_tokens=False
        )
        return pieces

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
        add_generation_prompt: bool,
    ) -> str:
        try:
            text = self._tok.apply_chat_template(
                list(messages),
                tools=tools or None,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except Exception as exc:
            # Templates raise on content they reject (jinja `raise_exception`);
            # that is the request's fault, not ours.
            raise InvalidRequest(f"chat template rejected the messages: {exc}") from exc
        if not isinstance(text, str):
            raise InvariantViolated(f"chat template returned {type(text).__name__}, not text")
        return text

    def first_turn(
        self, messages: Sequence[Message], *, tools: list[Any] | None, kwargs: Mapping[str, Any]
    ) -> list[int]:
        text = self.render(messages, tools=tools, kwargs=kwargs, add_generation_prompt=True)
        return self.encode(text)

    def _after_sentinel(self, text: str) -> str:
        at = text.find(_SENTINEL)
        if at < 0:
            raise InvariantViolated("chat template dropped the assistant turn of the context")
        return text[at + len(_SENTINEL) :]

    def turn_end(
        self, *, tools: list[Any] | None, kwargs: Mapping[str, Any]
    ) -> tuple[str, tuple[int, ...]]:
        """What the template renders after an assistant message's content, and
        its ids (kept per distinct tools and kwargs)."""
        try:
            # Order-preserving JSON: equal keys mean inputs the template cannot
            # tell apart (1 and 1.0, true and 1 serialise differently).
            key: bytes | None = orjson.dumps((tools or None, kwargs))
        except TypeError:  # not JSON (an embedding caller's kwargs): no caching
            key = None
        cached = self._turn_ends.get(key) if key is not None else None
        if cached is not None:
            return cached
        text = self._after_sentinel(
            self.render(_CONTEXT, tools=tools, kwargs=kwargs, add_generation_prompt=False)
        )
        entry = (text, tuple(self.encode(text)))
        if key is not None:
            # Single dict operations (atomic under the GIL): safe if plan_turn
            # runs on a worker thread; a full cache simply starts over.
            if len(self._turn_ends) >= _TURN_END_CACHE_SIZE:
                self._turn_ends.clear()
            self._turn_ends[key] = entry
        return entry

    def appended(
        self,
        new_messages: Sequence[Message],
        *,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
    ) -> tuple[list[int], list[int]]:
        """Ids of (assistant turn end, new messages + generation prompt).

        Rendering only the new messages after the synthetic context keeps the
        cost proportional to what is appended, whatever the history length.
        """
        turn_end, turn_end_ids = self.turn_end(tools=tools, kwargs=kwargs)
        text = self.render(
            [*_CONTEXT, *new_messages], tools=tools, kwargs=kwargs, add_generation_prompt=True
        )
        rest = self._after_sentinel(text)
        if not rest.startswith(turn_end):
            raise InvariantViolated(
                "chat template renders an assistant turn differently when more messages "
                "follow; it cannot be extended token-in/token-out"
            )
        return list(turn_end_ids), self.encode(rest[len(turn_end) :])


def missing_turn_end(sampled: Sequence[int] | IdArray, turn_end: Sequence[int]) -> list[int]:
    """The part of `turn_end` the sampled ids do not already end with.

    The longest k with ``sampled[-k:] == turn_end[:k]`` is already there
    (typically k=1: the EOS token the model sampled).
    """
    for k in range(min(len(turn_end), len(sampled)), 0, -1):
        if [int(t) for t in sampled[-k:]] == list(turn_end[:k]):
            return list(turn_end[k:])
    return list(turn_end)


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> ChatTokenizer:
    """Load an HF tokenizer directory offline; `chat_template` is a file path,
    a built-in name (``chatml``, ``qwen3``) or None for the tokenizer's own."""
    from transformers import AutoTokenizer

    template = None
    if chat_template:
        from .testing.tokenizer import BUILTIN_TEMPLATES, builtin_template

        if chat_template in BUILTIN_TEMPLATES:
            template = builtin_template(chat_template)
        else:
            template = Path(chat_template).read_text(encoding="utf-8")
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return ChatTokenizer(hf, template)
