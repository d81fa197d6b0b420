"""Tokenizer and chat template: turning messages into the ids the model reads.

Token-in/token-out (docs/api.md#history-rules). The first turn renders the chat template over
the whole request. Later turns never re-render history: the appended messages
are rendered after a fixed synthetic context — a user message, then an
assistant message whose content is a sentinel and whose tool calls are the
previous answer's (a template may render tool results from them: harmony
names the function, DeepSeek groups outputs) — and only the text after the
sentinel is tokenised. So the cost is O(new tokens), and templates that
rewrite history (Qwen3 strips earlier ``<think>`` blocks) cannot change stored
ids. How that text joins the sampled ids is `prompt.junction`.

Rendering the same context as the *last* turn (no new messages) gives what
the template makes of the assistant turn itself: the rendering of its tool
calls (which the sampled ids stand for) and the last-turn terminator. That
render depends only on the tools, kwargs and the previous answer's tool
calls, so it is kept per distinct triple (a bounded cache per tokenizer).

Messages reach the template as SGLang and vLLM hand them over
(`prompt.template_input`). A template's own ``raise_exception`` is the
request's fault (400); any other template failure is ours (500, logged).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jinja2
import orjson

from ..errors import InvalidRequest, InvariantViolated, TemplateCannotExtend
from .junction import Junction, terminator_length
from .messages import Message
from .template_input import ArgumentStyle, probe_argument_style, template_messages

__all__ = ["ChatTokenizer", "generation_stop_ids", "load_tokenizer", "read_chat_template"]

logger = logging.getLogger(__name__)

_SENTINEL: Final = "\u2063⟦rollout-session:assistant-turn⟧\u2063"
_USER: Final[Message] = {"role": "user", "content": "."}
_NO_SPLIT: Final = (
    "chat template renders neither the content of the previous assistant message "
    "nor its output after the generation prompt; it cannot be extended token-in/token-out"
)
# Distinct (tools, kwargs, previous tool calls) whose last-turn rendering is
# kept; a server sees a handful of tool sets, the bound only stops a hostile mix.
_SHAPE_CACHE_SIZE: Final = 256


@dataclass(frozen=True, slots=True)
class _Shape:
    """The synthetic context rendered as the last turn."""

    # The generation prompt the previous answer's output follows, for a
    # template that does not render its content (None: the sentinel marks it).
    prompt: str | None
    calls: str  # the template's rendering of the context's tool calls
    last_text: str  # what the template ends the last turn with
    last_terminator: tuple[int, ...]  # its ids


def _rendered(message: Message, text: str) -> bool:
    """Whether `text` shows `message`'s content: as is (trimmed, as templates
    often do) or JSON-escaped (templates that ``tojson`` tool results)."""
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        return True
    content = content.strip()
    return content in text or json.dumps(content, ensure_ascii=False)[1:-1] in text


# Texts at least this long are tokenised without holding the GIL (`encode`);
# shorter ones take the call with less overhead.
_GIL_FREE_CHARS = 16 * 1024


class ChatTokenizer:
    """An HF tokenizer plus the chat template the server renders with."""

    def __init__(
        self,
        hf_tokenizer: Any,
        chat_template: str | None = None,
        *,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        self._tok = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        self.chat_template: str | None = chat_template or getattr(
            hf_tokenizer, "chat_template", None
        )
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template; pass --chat-template")
        vocab: dict[str, int] = hf_tokenizer.get_vocab()
        # Ids are valid in 0 ≤ id < vocab_size, added tokens included.
        self.vocab_size: int = max(vocab.values()) + 1
        # No token covers more text than this many bytes (its UTF-8 length
        # over-counts byte-level and SentencePiece pieces): bounds a prompt's
        # tokens from below without rendering it (turn/limits.py).
        self.max_token_bytes: int = max(len(token.encode("utf-8")) for token in vocab)
        self.name_or_path: str = str(getattr(hf_tokenizer, "name_or_path", ""))
        self.special_ids: frozenset[int] = frozenset(
            int(i) for i, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special
        )
        eos = hf_tokenizer.eos_token_id
        self.eos_id: int | None = None if eos is None else int(eos)
        # Tokens that end a generation (generation_config.json's eos_token_id).
        self.stop_ids: frozenset[int] = frozenset(
            stop_ids if stop_ids is not None else ([] if eos is None else [eos])
        )
        self.arguments: ArgumentStyle = probe_argument_style(
            lambda messages: self._apply(messages, tools=None, kwargs={}, generation=False)
        )
        # orjson of (tools, kwargs, tool calls) -> the context rendered as last turn.
        self._shapes: dict[bytes, _Shape] = {}

    def encode(self, text: str) -> list[int]:
        if len(text) < _GIL_FREE_CHARS:
            ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
            return ids
        # `tokenizers` holds the GIL through `encode` but not `encode_batch`:
        # a long text tokenised on a thread must not stop the event loop.
        [encoding] = self._backend.encode_batch([text], add_special_tokens=False)
        batch_ids: list[int] = encoding.ids
        return batch_ids

    def decode_pieces(self, ids: Sequence[int] | Any) -> list[str]:
        """Each token decoded on its own, special tokens kept (for inspection).
        A token holding part of a multi-byte character decodes to U+FFFD."""
        pieces: list[str] = self._backend.decode_batch(
            [[int(i)] for i in ids], skip_special_tokens=False
        )
        return pieces

    def decode(self, ids: Sequence[int] | Any) -> str:
        """The text of `ids`, special tokens kept."""
        text: str = self._backend.decode([int(i) for i in ids], skip_special_tokens=False)
        return text

    def _apply(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
        generation: bool,
    ) -> str:
        text = self._tok.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=generation,
            **kwargs,
        )
        if not isinstance(text, str):
            raise InvariantViolated(f"chat template returned {type(text).__name__}, not text")
        return text

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
        add_generation_prompt: bool,
    ) -> str:
        try:
            return self._apply(
                template_messages(messages, self.arguments),
                tools=tools,
                kwargs=kwargs,
                generation=add_generation_prompt,
            )
        except InvariantViolated:
            raise
        except jinja2.TemplateError as exc:
            if type(exc) is jinja2.TemplateError:
                # The template's own `raise_exception`: it refuses the request.
                raise InvalidRequest(f"chat template rejected the messages: {exc}") from exc
            failure: Exception = exc
        except Exception as exc:
            failure = exc
        logger.error("chat template failed: %s: %s", type(failure).__name__, failure)
        raise InvariantViolated(
            f"chat template failed ({type(failure).__name__}: {failure})"
        ) from failure

    def first_turn(
        self, messages: Sequence[Message], *, tools: list[Any] | None, kwargs: Mapping[str, Any]
    ) -> list[int]:
        text = self.render(messages, tools=tools, kwargs=kwargs, add_generation_prompt=True)
        return self.encode(text)

    def _context(self, previous: Message) -> list[Message]:
        assistant: Message = {"role": "assistant", "content": _SENTINEL}
        if previous.get("tool_calls"):
            assistant["tool_calls"] = previous["tool_calls"]
        return [_USER, assistant]

    def _generation_prompt(
        self, text: str, tools: list[Any] | None, kwargs: Mapping[str, Any]
    ) -> str | None:
        """Where the previous answer's output starts in `text` (the context
        rendered as the last turn): None when the sentinel marks the end of
        its content; else the generation prompt of the context's user message,
        which templates that do not render a tool-call message's content
        (Llama 3, Mistral) put right before its output."""
        if _SENTINEL in text:
            return None
        prompt = self.render([_USER], tools=tools, kwargs=kwargs, add_generation_prompt=True)
        if text.startswith(prompt):
            return prompt
        raise InvariantViolated(_NO_SPLIT)

    @staticmethod
    def _after(text: str, prompt: str | None) -> str:
        """The text after the previous answer's content (see `_Shape.prompt`)."""
        if prompt is None:
            at = text.find(_SENTINEL)
            if at >= 0:
                return text[at + len(_SENTINEL) :]
        elif text.startswith(prompt):
            return text[len(prompt) :]
        raise InvariantViolated(_NO_SPLIT)

    def _shape(self, calls: Any, tools: list[Any] | None, kwargs: Mapping[str, Any]) -> _Shape:
        try:
            # Order-preserving JSON: equal keys mean inputs the template cannot
            # tell apart (1 and 1.0, true and 1 serialise differently).
            key: bytes | None = orjson.dumps((tools or None, kwargs, calls or None))
        except TypeError:  # not JSON (an embedding caller's kwargs): no caching
            key = None
        cached = self._shapes.get(key) if key is not None else None
        if cached is not None:
            return cached
        context = self._context({"tool_calls": calls})
        text = self.render(context, tools=tools, kwargs=kwargs, add_generation_prompt=False)
        prompt = self._generation_prompt(text, tools, kwargs)
        after = self._after(text, prompt)
        if not calls:
            shape = _Shape(prompt, "", after, tuple(self.encode(after)))
        else:
            # The tool calls' rendering ends where the plain turn's terminator
            # begins; a template that ends a tool-call turn its own way
            # (harmony's <|call|>, Llama's <|eom_id|>) ends it with a token the
            # model sampled, so all of it is the calls'.
            plain = self._shape(None, tools, kwargs)
            end = plain.last_text
            if end and after.endswith(end):
                shape = _Shape(prompt, after[: len(after) - len(end)], end, plain.last_terminator)
            else:
                shape = _Shape(prompt, after, "", ())
        if key is not None:
            # Single dict operations (atomic under the GIL): safe if plan_turn
            # runs on a worker thread; a full cache simply starts over.
            if len(self._shapes) >= _SHAPE_CACHE_SIZE:
                self._shapes.clear()
            self._shapes[key] = shape
        return shape

    def last_terminator(
        self, previous: Message, *, tools: list[Any] | None, kwargs: Mapping[str, Any]
    ) -> tuple[int, ...]:
        """What the template writes after an answer shaped like `previous`
        when it is the last message (e.g. ``<|im_end|>\\n``)."""
        return self._shape(previous.get("tool_calls"), tools, kwargs).last_terminator

    def junction(
        self,
        previous: Message,
        new_messages: Sequence[Message],
        *,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
    ) -> Junction:
        """What follows the content of `previous` (the last answer) when
        `new_messages` are appended: history terminator, the new messages and
        the generation prompt, rendered after the synthetic context.

        Rendering only the new messages after the synthetic context keeps the
        cost proportional to what is appended, whatever the history length.
        """
        shape = self._shape(previous.get("tool_calls"), tools, kwargs)
        text = self.render(
            [*self._context(previous), *new_messages],
            tools=tools,
            kwargs=kwargs,
            add_generation_prompt=True,
        )
        after = self._after(text, shape.prompt)
        for i, message in enumerate(new_messages):
            if not _rendered(message, after):
                raise TemplateCannotExtend(
                    f"the chat template does not render appended message {i} (role "
                    f"{message['role']!r}) after the history: it drops the message or moves it "
                    "before the history, so it cannot be appended token-in/token-out "
                    "(`rollout-session check-template` reports this per role)",
                    param="messages",
                )
        if not after.startswith(shape.calls):
            raise InvariantViolated(
                "chat template renders the previous answer's tool calls differently when "
                "messages follow; it cannot be extended token-in/token-out"
            )
        ids = tuple(self.encode(after[len(shape.calls) :]))
        return Junction(ids, terminator_length(shape.last_terminator, ids, self.special_ids))


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> ChatTokenizer:
    """Load an HF tokenizer directory offline; `chat_template` is a file path,
    a built-in name (``chatml``, ``qwen3``) or None for the tokenizer's own."""
    from transformers import AutoTokenizer

    template = read_chat_template(chat_template) if chat_template else None
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return ChatTokenizer(hf, template, stop_ids=generation_stop_ids(path))


def read_chat_template(name_or_path: str) -> str:
    """A built-in template's text (``chatml``, ``qwen3``) or a template file's."""
    from .builtin import BUILTIN_TEMPLATES, builtin_template

    if name_or_path in BUILTIN_TEMPLATES:
        return builtin_template(name_or_path)
    return Path(name_or_path).read_text(encoding="utf-8")


def generation_stop_ids(path: str | Path) -> list[int] | None:
    """``eos_token_id`` of the model directory's ``generation_config.json``
    (an id or a list), or None when it has none."""
    try:
        config = json.loads((Path(path) / "generation_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    ids = config.get("eos_token_id") if isinstance(config, dict) else None
    if isinstance(ids, int):
        return [ids]
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return ids
    return None
