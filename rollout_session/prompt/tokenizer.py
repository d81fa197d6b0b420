"""Tokenizer and chat template: turning messages into the ids the model reads.

Token-in/token-out (docs/api.md#history-rules). The first turn renders the chat template over
the whole request. Later turns never re-render history: the appended messages
are rendered after a fixed synthetic context — a user message, then an
assistant message whose content is a sentinel and whose tool calls are the
previous answer's (a template may render tool results from them: harmony
names the function, DeepSeek groups outputs) — and only the text after the
previous answer is tokenised (the *tail*). So the cost is O(new tokens), and
templates that rewrite history (Qwen3 strips earlier ``<think>`` blocks)
cannot change stored ids. How the tail joins the sampled ids is
`prompt.junction`.

Rendering the same context as the *last* turn (no new messages) gives what
the template makes of the assistant turn itself: the rendering of its tool
calls (which the sampled ids stand for) and the last-turn terminator. That
render depends only on the template, the tools, kwargs and the previous
answer's tool calls, so it is kept per distinct triple (a bounded cache per
tokenizer). Where history renders the calls differently from the last turn,
the tail is located by rendering the calls with other argument values: what
stays the same after them is the tail (`ChatTokenizer._varied_tail`).

A tokenizer may carry several named templates (transformers' list form of
``chat_template``): like transformers and vLLM, a request with tools is
rendered with ``tool_use`` when there is one, any other with ``default``
(`ChatTokenizer.template_for`). Tools are fixed for a segment (other tools
start a new one), so a segment never mixes templates. ``--chat-template``
(a file, a built-in or one of the names) serves one template for all.

A template whose appended messages depend on the history (Command-R7B
numbers tool results across the conversation) is not served by the
synthetic context alone: the start-up check finds it, and each of its turns
asks `appends_alike` whether the template writes the same after the real
history (docs/templates.md#history-dependent-templates).

Messages reach the template as SGLang and vLLM hand them over
(`prompt.template_input`). A template's own ``raise_exception`` is the
request's fault (400); any other template failure is ours (500, logged).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jinja2
import orjson

from ..errors import InvalidRequest, InvariantViolated, TemplateCannotExtend
from .bounded import PromptTooLong, encode_within
from .junction import Junction, terminator_length
from .messages import Message
from .prefix_cache import PrefixCache
from .template_input import ArgumentStyle, probe_argument_style, template_messages

__all__ = [
    "ChatTokenizer",
    "Template",
    "generation_stop_ids",
    "load_tokenizer",
    "read_chat_template",
]

logger = logging.getLogger(__name__)

_SENTINEL: Final = "\u2063⟦rollout-session:assistant-turn⟧\u2063"
_USER: Final[Message] = {"role": "user", "content": "."}
_NO_SPLIT: Final = (
    "chat template renders neither the content of the previous assistant message "
    "nor its output after the generation prompt; it cannot be extended token-in/token-out"
)
_NO_TAIL: Final = (
    "chat template renders the previous answer's tool calls differently when messages "
    "follow, and what follows them cannot be told apart from them; it cannot be "
    "extended token-in/token-out"
)
# What a varied copy of the previous answer's calls carries in place of each
# argument value (`_varied_calls`): text no real argument ends with.
_VARIED: Final = "\u2063rollout-session:varied\u2063"
# Distinct (tools, kwargs, previous tool calls) whose last-turn rendering is
# kept; a server sees a handful of tool sets, the bound only stops a hostile mix.
_SHAPE_CACHE_SIZE: Final = 256
# The names transformers' `get_chat_template` picks among a tokenizer's templates.
_DEFAULT: Final = "default"
_TOOL_USE: Final = "tool_use"
# A tool any template can render: the start-up probes give it to templates
# that render only with tools (``{% for tool in tools %}`` on None raises).
_PROBE_TOOLS: Final = (
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "probe",
            "parameters": {
                "type": "object",
                "properties": {"probe": {"type": "integer", "description": "probe"}},
                "required": ["probe"],
            },
        },
    },
)


@dataclass(frozen=True, slots=True)
class Template:
    """One chat template the server renders with."""

    name: str | None  # its name in the tokenizer's list (None: the only one)
    text: str
    arguments: ArgumentStyle  # how it wants tool-call arguments (probed)
    # It renders only when tools are given (Hermes' ``tool_use`` iterates
    # ``tools`` unguarded): a request without tools is refused (400).
    needs_tools: bool

    @property
    def label(self) -> str:
        """How messages name it."""
        return "the chat template" if self.name is None else f"chat template {self.name!r}"


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


def _unrendered(messages: Sequence[Message], text: str) -> int | None:
    """The index of the first of `messages` whose content `text` lacks."""
    return next((i for i, m in enumerate(messages) if not _rendered(m, text)), None)


def _common_suffix(a: str, b: str) -> int:
    """How many trailing characters `a` and `b` share."""
    n = 0
    for x, y in zip(reversed(a), reversed(b), strict=False):
        if x != y:
            break
        n += 1
    return n


def _varied_calls(calls: Any) -> list[dict[str, Any]] | None:
    """`calls` with every argument value replaced (names, ids and keys kept,
    so tool results render the same), or None when no call has an argument
    to vary (nothing would tell the calls from what follows them)."""
    if not isinstance(calls, list):
        return None
    varied = []
    changed = False
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("arguments"), dict):
            return None
        arguments: dict[str, Any] = function["arguments"]
        changed = changed or bool(arguments)
        varied.append(
            {**call, "function": {**function, "arguments": dict.fromkeys(arguments, _VARIED)}}
        )
    return varied if changed else None


# The roles a shared head is made of (`ChatTokenizer._shared_prefix`).
_LEAD_ROLES: Final = frozenset({"system", "developer"})


class ChatTokenizer:
    """An HF tokenizer plus the chat template(s) the server renders with."""

    def __init__(
        self,
        hf_tokenizer: Any,
        chat_template: str | None = None,
        *,
        stop_ids: Sequence[int] | None = None,
        name: str | None = None,
    ) -> None:
        """`chat_template`: the one template to serve (`name`: its name among
        the tokenizer's, if it is one); None serves the tokenizer's own, one
        template or several named ones."""
        self._tok = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        vocab: dict[str, int] = hf_tokenizer.get_vocab()
        # Ids are valid in 0 ≤ id < vocab_size, added tokens included.
        self.vocab_size: int = max(vocab.values()) + 1
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
        plain, tooled = self._choose(chat_template, name)
        self._plain: Template = self._probe(*plain)
        self._tooled: Template = (
            self._plain if tooled is None or tooled == plain else self._probe(*tooled)
        )
        # The template of requests without tools (the only one, or `default`).
        self.chat_template: str = self._plain.text
        # orjson of (tools, kwargs, tool calls) -> the context rendered as last turn.
        self._shapes: dict[bytes, _Shape] = {}
        added = hf_tokenizer.added_tokens_decoder.values()
        self.prefixes = PrefixCache(self.encode, ((t.content, t.special, t.rstrip) for t in added))

    def _choose(
        self, chat_template: str | None, name: str | None
    ) -> tuple[tuple[str | None, str], tuple[str | None, str] | None]:
        """((name, text) without tools, (name, text) with tools or None: the same)."""
        if chat_template:
            return (name, chat_template), None
        own = getattr(self._tok, "chat_template", None)
        if isinstance(own, Mapping) and own:
            # transformers' `get_chat_template`: `tool_use` when tools are
            # given and the tokenizer has one, else `default`.
            if _DEFAULT not in own:
                raise ValueError(
                    f"the tokenizer has several chat templates ({', '.join(sorted(own))}) "
                    f"and none is named {_DEFAULT!r}; pass --chat-template NAME"
                )
            plain = (_DEFAULT, str(own[_DEFAULT]))
            tooled = (_TOOL_USE, str(own[_TOOL_USE])) if _TOOL_USE in own else None
            return plain, tooled
        if isinstance(own, str) and own:
            return (None, own), None
        raise ValueError("the tokenizer has no chat template; pass --chat-template")

    def _probe(self, name: str | None, text: str) -> Template:
        """The template with what is probed of it once: whether it renders
        without tools, and the tool-call argument style it accepts."""
        probe = Template(name, text, ArgumentStyle.DICT, needs_tools=False)
        needs_tools = not self._renders(probe, None) and self._renders(probe, list(_PROBE_TOOLS))
        tools = list(_PROBE_TOOLS) if needs_tools else None
        arguments = probe_argument_style(
            lambda messages: self._apply(
                messages, tools=tools, kwargs={}, generation=False, template=probe
            )
        )
        return Template(name, text, arguments, needs_tools=needs_tools)

    def _renders(self, template: Template, tools: list[Any] | None) -> bool:
        """Whether `template` renders a user message with `tools`."""
        try:
            self._apply([dict(_USER)], tools=tools, kwargs={}, generation=True, template=template)
        except Exception:  # the template's own failure is the probe's answer
            return False
        return True

    @property
    def templates(self) -> tuple[Template, ...]:
        """The templates requests are rendered with: one, or the one without
        tools then the one with tools."""
        if self._tooled is self._plain:
            return (self._plain,)
        return (self._plain, self._tooled)

    def template_for(self, tools: Sequence[Any] | None) -> Template:
        """The template a request with `tools` is rendered with. As
        transformers' `get_chat_template` and vLLM do per request, but on the
        tools the template receives (none for an empty list)."""
        return self._tooled if tools else self._plain

    @property
    def arguments(self) -> ArgumentStyle:
        """The argument style of the template of requests without tools."""
        return self._plain.arguments

    def encode(self, text: str) -> list[int]:
        # `encode_batch_fast`: the tokenizer's own fast path, the same ids
        # without the offsets (docs/performance.md#tokenising-without-offsets);
        # and unlike `encode` it does not hold the GIL, so a long text
        # tokenised on a thread does not stop the event loop.
        [encoding] = self._backend.encode_batch_fast([text], add_special_tokens=False)
        ids: list[int] = encoding.ids
        return ids

    @property
    def hf(self) -> Any:
        """The HF tokenizer itself (an engine that decodes as its workers do
        calls its `decode`, with its defaults)."""
        return self._tok

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
        template: Template,
    ) -> str:
        text = self._tok.apply_chat_template(
            messages,
            tools=tools or None,
            # The text, never a name: with several templates, transformers
            # would pick by `tools`; the choice is `template_for`'s.
            chat_template=template.text,
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
        template = self.template_for(tools)
        if template.needs_tools and not tools:
            raise InvalidRequest(
                f"{template.label} renders only with tools: send `tools`, or serve "
                "another template (--chat-template)",
                param="tools",
            )
        try:
            return self._apply(
                template_messages(messages, template.arguments),
                tools=tools,
                kwargs=kwargs,
                generation=add_generation_prompt,
                template=template,
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
        self,
        messages: Sequence[Message],
        *,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
        most: int | None = None,
    ) -> list[int]:
        """The whole request's prompt ids; `PromptTooLong` past `most` tokens
        (`prompt.bounded`: refused for about the cost of `most` tokens). The
        ids of a head many sessions share come from `prefixes`."""
        text = self.render(messages, tools=tools, kwargs=kwargs, add_generation_prompt=True)
        shared = self._shared_prefix(messages, tools, kwargs, text, most)
        if shared is None:
            return encode_within(self.encode, text, most)
        prefix, prefix_ids = shared
        room = None if most is None else most - len(prefix_ids)
        try:
            rest = encode_within(self.encode, text[len(prefix) :], room)
        except PromptTooLong as exc:
            raise PromptTooLong(len(prefix_ids) + exc.at_least) from None
        prefix_ids.extend(rest)
        return self.prefixes.checked(text, prefix_ids)

    def _shared_prefix(
        self,
        messages: Sequence[Message],
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
        text: str,
        most: int | None,
    ) -> tuple[str, list[int]] | None:
        """The cached prefix of `text`: its leading system and developer
        messages (with the tools and kwargs: the key) rendered alone."""
        lead = list(itertools.takewhile(lambda m: m["role"] in _LEAD_ROLES, messages))
        try:
            key = orjson.dumps((tools or None, kwargs, lead))
        except TypeError:  # not JSON (an embedding caller's kwargs): no caching
            return None

        def head() -> str | None:
            template = self.template_for(tools)
            try:
                return self._apply(
                    template_messages(lead, template.arguments),
                    tools=tools,
                    kwargs=kwargs,
                    generation=False,
                    template=template,
                )
            except Exception:  # e.g. a template that wants a user message: no entry
                return None

        return self.prefixes.lookup(key, text, head, most)

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

    def _trailer(self, after: str, plain: _Shape) -> tuple[str, tuple[int, ...]] | None:
        """The longest part of the plain last turn's ending, from a special
        token on, that the tool-call turn `after` ends with too: what the
        template writes after *any* last turn (Command-R7B's closing
        ``<|END_OF_TURN_TOKEN|>`` and the generation prompt it always adds),
        which is no part of the calls. None when there is none."""
        ids = plain.last_terminator
        for i in range(1, len(ids)):
            if ids[i] not in self.special_ids:
                continue
            text = self.decode(ids[i:])
            if plain.last_text.endswith(text) and after.endswith(text):
                return text, ids[i:]
        return None

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
            # begins (or what of it the template writes after any last turn:
            # `_trailer`); a template that ends a tool-call turn its own way
            # (harmony's <|call|>, Llama's <|eom_id|>) ends it with a token the
            # model sampled, so all of it is the calls'.
            plain = self._shape(None, tools, kwargs)
            end = plain.last_text
            trailer = (
                (end, plain.last_terminator)
                if end and after.endswith(end)
                else self._trailer(after, plain)
            )
            if trailer is None:
                shape = _Shape(prompt, after, "", ())
            else:
                text_end, ids_end = trailer
                shape = _Shape(prompt, after[: len(after) - len(text_end)], text_end, ids_end)
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

    def _followed(
        self,
        previous: Message,
        shape: _Shape,
        new_messages: Sequence[Message],
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
    ) -> str:
        """The text after the previous answer's content when `new_messages`
        follow it (history terminator, new messages, generation prompt)."""
        text = self.render(
            [*self._context(previous), *new_messages],
            tools=tools,
            kwargs=kwargs,
            add_generation_prompt=True,
        )
        return self._after(text, shape.prompt)

    def _varied_tail(
        self,
        previous: Message,
        after: str,
        shape: _Shape,
        new_messages: Sequence[Message],
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
    ) -> str:
        """The tail of `after` (what follows the previous answer's calls) when
        history renders the calls otherwise than the last turn did (ids, a
        ``<|python_tag|>`` or other argument formatting in history only).

        The calls are rendered once more with every argument value replaced:
        what `after` keeps unchanged at its end is the calls' closing and the
        tail. The closing must be the one the last turn writes after the
        values (the model sampled that turn); what follows it is the tail,
        the same whatever the calls hold. Anything else cannot be located:
        `InvariantViolated`.
        """
        calls = previous.get("tool_calls")
        varied = _varied_calls(calls)
        if varied is None:
            raise InvariantViolated(_NO_TAIL)
        other = self._shape(varied, tools, kwargs)
        closing = shape.calls[len(shape.calls) - _common_suffix(shape.calls, other.calls) :]
        other_after = self._followed({"tool_calls": varied}, other, new_messages, tools, kwargs)
        same = after[len(after) - _common_suffix(after, other_after) :]
        if not closing or not same.startswith(closing):
            raise InvariantViolated(_NO_TAIL)
        return same[len(closing) :]

    def appends_alike(
        self,
        history: Sequence[Message],
        previous: Message,
        new_messages: Sequence[Message],
        *,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
    ) -> bool:
        """Whether the template writes the same after the content of
        `previous` (the last answer) when `new_messages` follow, with the
        real `history` before it as with the synthetic context: `junction`'s
        ids are then the template's own after this history. False also when
        the answer's place in the real render cannot be told.

        One render of the whole conversation, not tokenised: the price of a
        template whose appended messages depend on the history
        (docs/templates.md#history-dependent-templates)."""
        shape = self._shape(previous.get("tool_calls"), tools, kwargs)
        synthetic = self._followed(previous, shape, new_messages, tools, kwargs)
        [_, answer] = self._context(previous)
        text = self.render(
            [*history, answer, *new_messages],
            tools=tools,
            kwargs=kwargs,
            add_generation_prompt=True,
        )
        if shape.prompt is None:  # the sentinel marks the end of the content
            at = text.find(_SENTINEL)
            return at >= 0 and text[at + len(_SENTINEL) :] == synthetic
        # A template that does not render a tool-call message's content:
        # `synthetic` opens with the calls' rendering, so the render ending
        # with it has the answer's calls, then the same appended text.
        return bool(previous.get("tool_calls")) and text.endswith(synthetic)

    def unrendered(
        self,
        previous: Message,
        new_messages: Sequence[Message],
        *,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
    ) -> int | None:
        """The index of the first of `new_messages` the template does not
        render after `previous` (it drops or moves it): why `junction` raised
        `TemplateCannotExtend`; None when it renders them all."""
        shape = self._shape(previous.get("tool_calls"), tools, kwargs)
        return _unrendered(
            new_messages, self._followed(previous, shape, new_messages, tools, kwargs)
        )

    def junction(
        self,
        previous: Message,
        new_messages: Sequence[Message],
        *,
        tools: list[Any] | None,
        kwargs: Mapping[str, Any],
        most: int | None = None,
    ) -> Junction:
        """What follows the content of `previous` (the last answer) when
        `new_messages` are appended: history terminator, the new messages and
        the generation prompt, rendered after the synthetic context.
        `PromptTooLong` when the prompt it adds holds more than `most` tokens.

        Rendering only the new messages after the synthetic context keeps the
        cost proportional to what is appended, whatever the history length.
        """
        shape = self._shape(previous.get("tool_calls"), tools, kwargs)
        after = self._followed(previous, shape, new_messages, tools, kwargs)
        i = _unrendered(new_messages, after)
        if i is not None:
            raise TemplateCannotExtend(
                f"the chat template does not render appended message {i} (role "
                f"{new_messages[i]['role']!r}) after the history: it drops the message or "
                "moves it before the history, so it cannot be appended token-in/token-out "
                "(`rollout-session check-template` reports this per role)",
                param="messages",
            )
        if after.startswith(shape.calls):
            tail = after[len(shape.calls) :]
        else:
            # The sampled ids are kept whatever history makes of the calls:
            # only the tail after them must be found.
            tail = self._varied_tail(previous, after, shape, new_messages, tools, kwargs)
        # The history terminator may give way to a sampled stop token
        # (`continuation`): the prompt can hold that many fewer ids.
        bound = None if most is None else most + len(shape.last_terminator)
        ids = tuple(encode_within(self.encode, tail, bound))
        return Junction(ids, terminator_length(shape.last_terminator, ids, self.special_ids))


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> ChatTokenizer:
    """Load an HF tokenizer directory offline. `chat_template`: None for the
    tokenizer's own (one, or several named ones chosen per request), else the
    one template to serve: the name of one of the tokenizer's templates (as
    transformers and vLLM take it), a built-in name (``chatml``, ``qwen3``)
    or a file path."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    stop_ids = generation_stop_ids(path)
    own = getattr(hf, "chat_template", None)
    if chat_template and isinstance(own, Mapping) and chat_template in own:
        return ChatTokenizer(hf, str(own[chat_template]), stop_ids=stop_ids, name=chat_template)
    template = read_chat_template(chat_template) if chat_template else None
    return ChatTokenizer(hf, template, stop_ids=stop_ids)


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
