"""The emulator's fake language model: what it samples for one completion.

Owns what the model does for one completion: the model's choice to call a
tool, deterministic words for its text and reasoning, and the answer's
tokens. The tokens are what a model trained on the chat template samples for
that answer (`rollout_session.prompt.model_output`): the template's own
rendering of the answer as the last turn, through its stop token — so the
emulator speaks each family's tool-call, reasoning and end-of-turn format
(Qwen's ``<tool_call>`` JSON, Llama's bare JSON before ``<|eot_id|>``,
DeepSeek's ``<｜tool▁calls▁begin｜>``, harmony channels ending ``<|call|>`` or
``<|return|>``, GLM stopping on the next role marker) with no per-family
table. The parsed message SGLang would return is the answer itself, as its
tool-call and reasoning parsers would give it back. The model's logprobs of
the sampled ids (`logprobs.LogprobModel`, given by the caller) and the finish
reason complete the sample; the response JSON is `sglang.answer`.

Ids are canonical (they are the tokenisation of the rendered text), so a
re-render of the conversation reproduces them wherever the template does not
rewrite history. Only a completion cut by ``max_tokens`` ends mid-answer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from rollout_session.prompt.messages import Message
from rollout_session.prompt.model_output import CallIds, answer_ids
from rollout_session.prompt.tokenizer import ChatTokenizer

from .prompt_reader import PromptReader, Reading

__all__ = [
    "WORDS",
    "Sample",
    "SampleSpec",
    "Speaker",
    "TextModel",
    "choose_tools",
    "derive_seed",
]

# Common English words; the ones that are not single tokens in the loaded
# tokenizer are dropped at start-up.
WORDS: Final = (
    "the", "model", "reads", "data", "from", "file", "and", "returns", "a", "result",
    "value", "list", "with", "each", "new", "line", "test", "code", "user", "tool",
    "call", "time", "state", "token", "system", "query", "answer", "check", "run", "step",
    "plan", "next", "path", "name", "type", "field", "error", "case", "input", "output",
    "server", "client", "request", "batch", "queue", "cache", "block", "prefix", "turn", "agent",
    "task", "note", "work", "table", "row", "size", "number", "first", "last", "good",
    "small", "large", "open", "close", "find", "make", "use", "keep",
)  # fmt: skip
_MIN_WORDS: Final = 16
# Default completion length range (sampled tokens including the end token).
_DEFAULT_LENGTH: Final = (8, 25)
# A sentence ends after this many words on average.
_SENTENCE_WORDS: Final = 10


def derive_seed(config_seed: int, request_seed: int | None, prompt_ids: Sequence[int]) -> int:
    """Seed of one completion: same config seed, request seed and prompt → same output."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{config_seed}:{request_seed}:".encode())
    h.update(np.asarray(prompt_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class SampleSpec:
    """What one completion should look like.

    ``tools`` are the OpenAI ``function`` objects to call, in one answer
    (none: answer with text). ``target_tokens`` asks for that many sampled tokens including the
    end token (text answers; met exactly where every word is one token).
    ``max_tokens`` is the hard budget: a longer completion is cut and
    finishes with ``length``.
    """

    seed: int
    max_tokens: int
    target_tokens: int | None = None
    tools: tuple[dict[str, Any], ...] = ()
    reasoning: bool = False


@dataclass(frozen=True)
class Sample:
    """One completion: sampled ids (with the stop token when it stopped),
    logprobs, and the message SGLang's parsers make of them.

    A sample can be a piece of a longer answer (`Speaker.segment`): the
    tokens ``[offset, offset + len(ids))`` of ``whole``, the model's whole
    answer (a continuation's rest, an aborted answer's tokens so far).
    """

    ids: list[int]
    logprobs: list[float]
    finish: dict[str, Any]  # SGLang's meta_info.finish_reason
    reasoning_tokens: int
    message: dict[str, Any]
    # The answer the model wrote (content, reasoning, tool calls with their
    # arguments as objects): what a piece's parsed message is made from.
    answer: dict[str, Any] | None = None
    offset: int = 0
    whole: Sample | None = None


class TextModel:
    """The word list over a real tokenizer (shareable between emulators).

    Building one costs a vocabulary scan (~0.1 s for 129k tokens).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = max(tokenizer.get_vocab().values()) + 1
        # Built once per (template, stop ids): a ChatTokenizer scans the
        # vocabulary, which emulators sharing this model need not repeat.
        self._templates: dict[tuple[str | None, tuple[int, ...] | None], ChatTokenizer] = {}
        self.words: tuple[str, ...] = tuple(
            w for w in WORDS if len(self.encode(w)) == 1 and len(self.encode(" " + w)) == 1
        )
        if len(self.words) < _MIN_WORDS:
            raise ValueError(
                f"only {len(self.words)} words of the emulator's word list are single tokens "
                f"in this tokenizer; need {_MIN_WORDS}"
            )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_tokenizer(
        self, chat_template: str | None, stop_ids: Sequence[int] | None
    ) -> ChatTokenizer:
        """This model's tokenizer speaking `chat_template` (None: its own)."""
        key = (chat_template, None if stop_ids is None else tuple(stop_ids))
        template = self._templates.get(key)
        if template is None:
            template = self._templates[key] = ChatTokenizer(
                self.tokenizer, chat_template, stop_ids=stop_ids
            )
        return template

    def words_text(self, rng: np.random.Generator, n: int) -> str:
        picks = rng.integers(0, len(self.words), n)
        ends = rng.integers(0, _SENTENCE_WORDS, n) == 0
        ends[-1] = True
        return " ".join(
            self.words[i] + "." if end else self.words[i]
            for i, end in zip(picks, ends, strict=True)
        )


# Reasoning markers of the <think> families (Qwen3, DeepSeek-R1, GLM).
_THINK = ("<think>", "</think>")


class Speaker:
    """A `TextModel` speaking one chat template's output format."""

    def __init__(self, model: TextModel, template: ChatTokenizer) -> None:
        self.model = model
        self.template = template
        self.call_ids = CallIds(template)
        self.reader = PromptReader(template, self.call_ids(0))

    def read(self, prompt_ids: Sequence[int]) -> Reading:
        """What the model reads from its prompt (`prompt_reader`)."""
        return self.reader.read(prompt_ids)

    def sample(
        self, spec: SampleSpec, reading: Reading, score: Callable[[list[int]], list[float]]
    ) -> Sample:
        """The model's answer to the prompt `reading` read; `score` gives the
        model's logprobs of answer ids after that prompt (`LogprobModel`)."""
        rng = np.random.default_rng(spec.seed)
        context = reading.context(self.call_ids(0))
        tools, kwargs = reading.openai_tools, reading.kwargs
        answer: Message = {"role": "assistant", "content": ""}
        if spec.reasoning:
            answer["reasoning_content"] = self.model.words_text(rng, int(rng.integers(4, 11)))
        if spec.tools:
            answer["tool_calls"] = [
                {
                    "id": self.call_ids(spec.seed + i),
                    "type": "function",
                    "function": {
                        "name": function["name"],
                        "arguments": _schema_value(
                            {"type": "object", **function.get("parameters", {})}, rng
                        ),
                    },
                }
                for i, function in enumerate(spec.tools)
            ]
            ids = self._ids(context, answer, tools, kwargs)
            if not self._shows_calls(ids, answer) and len(answer["tool_calls"]) > 1:
                # The template writes one call per answer (harmony's): so
                # does a model trained on it.
                answer["tool_calls"] = answer["tool_calls"][:1]
                ids = self._ids(context, answer, tools, kwargs)
            if not self._shows_calls(ids, answer):
                # The template cannot write the calls (DeepSeek-R1's writes
                # them only for a null content, which messages never have):
                # a model trained on it answers in text instead.
                del answer["tool_calls"]
                ids = self._text(rng, spec.target_tokens, context, answer, tools, kwargs)
        else:
            ids = self._text(rng, spec.target_tokens, context, answer, tools, kwargs)
        stopped = ids[-1] in self.template.stop_ids
        finish: dict[str, Any] = {"type": "stop", "matched": ids[-1]}
        # The model's logprobs of its tokens in context (`LogprobModel`):
        # scored for the whole answer, so a cut answer's are the whole one's first.
        logprobs = score(ids)
        if len(ids) > spec.max_tokens:
            ids, logprobs = ids[: spec.max_tokens], logprobs[: spec.max_tokens]
            finish = {"type": "length", "length": spec.max_tokens}
        elif not stopped:  # a template whose output names no stop token
            finish = {"type": "stop", "matched": None}
        message = self._message(answer, ids, finish["type"] == "length")
        reasoning = message.get("reasoning_content")
        return Sample(ids, logprobs, finish, self._reasoning_tokens(reasoning), message, answer)

    def segment(self, sample: Sample, start: int, end: int, finish: dict[str, Any]) -> Sample:
        """The tokens ``[start, end)`` of ``sample`` as a sample of their own,
        finishing with ``finish``: an aborted answer's tokens so far
        (``start`` 0), a continuation's rest (the whole answer's tokens
        after the ones its prompt ends with). Its message is what the
        parsers make of those tokens alone (`_piece_message`)."""
        root = sample.whole or sample
        start, end = sample.offset + start, sample.offset + end
        ids = root.ids[start:end]
        answer = root.answer or root.message
        if start == 0 and end == len(root.ids):
            message = root.message
        elif start == 0:
            message = self._message(answer, ids, cut=True)
        else:
            message = self._piece_message(root, start, end)
        reasoning = message.get("reasoning_content")
        return Sample(
            ids,
            root.logprobs[start:end],
            finish,
            self._reasoning_tokens(reasoning),
            message,
            answer,
            start,
            root if start or end != len(root.ids) else None,
        )

    def _piece_message(self, root: Sample, start: int, end: int) -> dict[str, Any]:
        """The message of the tokens ``[start, end)`` of the answer ``root``
        (``start`` > 0), read as a continuation of the tokens before it: if
        those left a ``<think>`` block open, the piece's text up to
        ``</think>`` is reasoning (all of it when the block does not close
        in the piece, and the whitespace after it is dropped); the tool
        calls are reported when the piece holds them whole (it runs to the
        answer's end and no call began before it); the rest of the text,
        special tokens skipped, is the content."""
        answer = root.answer or root.message
        head = self.template.decode(root.ids[:start])
        plain = str(self.model.tokenizer.decode(root.ids[start:end], skip_special_tokens=True))
        reasoning: str | None = None
        if answer.get("reasoning_content") and _THINK[0] in head and _THINK[1] not in head:
            thought, _, plain = plain.partition(_THINK[1])
            reasoning, plain = thought.strip() or None, plain.lstrip()
        message: dict[str, Any] = {"role": "assistant", "content": plain}
        calls = root.message.get("tool_calls") or []
        if calls and end == len(root.ids) and not any(c["function"]["name"] in head for c in calls):
            message["content"] = root.message.get("content") or ""
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = reasoning
        return message

    def _ids(
        self,
        context: list[Message],
        answer: Message,
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> list[int]:
        try:
            return answer_ids(self.template, context, answer, tools=tools, kwargs=kwargs)
        except Exception as exc:  # the template refuses: SGLang's 400
            raise ValueError(f"cannot render the chat template: {exc}") from exc

    def _text(
        self,
        rng: np.random.Generator,
        target: int | None,
        context: list[Message],
        answer: Message,
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> list[int]:
        if target is None:
            length = int(rng.integers(*_DEFAULT_LENGTH)) - 1
            answer["content"] = self.model.words_text(rng, length)
            return self._ids(context, answer, tools, kwargs)
        # The answer's frame (reasoning, markup, stop token) is measured once
        # with empty content; the content is then cut to fill the rest, after
        # a word (every word is one token, with or without its space), and
        # checked, adjusting in the rare case the junction tokenises apart.
        answer["content"] = ""
        frame = len(self._ids(context, answer, tools, kwargs))
        # A word is a token, a sentence's period one more: enough words.
        words = self.template.encode(self.model.words_text(rng, target + 8))
        n = max(0, target - frame)
        ids: list[int] = []
        for _ in range(4):
            answer["content"] = self.template.decode(words[:n])
            ids = self._ids(context, answer, tools, kwargs)
            if len(ids) == target or (n == 0 and len(ids) > target):
                break
            n = max(0, min(len(words), n + target - len(ids)))
        return ids

    def _message(self, answer: Message, ids: list[int], cut: bool) -> dict[str, Any]:
        """What SGLang's reasoning and tool-call parsers return for `ids`."""
        if cut:
            raw = self.template.decode(ids)
            if answer.get("reasoning_content") and _THINK[0] in raw and _THINK[1] not in raw:
                # SGLang's reasoning parser: an unclosed think block is all
                # reasoning, and nothing is left for the content.
                thought = raw.split(_THINK[0], 1)[1].strip()
                return {"role": "assistant", "content": "", "reasoning_content": thought}
            # A parser finds no complete call in a cut answer: all is text.
            text = self.model.tokenizer.decode(ids, skip_special_tokens=True)
            return {"role": "assistant", "content": text}
        message: dict[str, Any] = {"role": "assistant", "content": answer["content"]}
        reasoning = answer.get("reasoning_content")
        # Reasoning the template's output does not show was not sampled.
        if reasoning and reasoning in self.template.decode(ids):
            message["reasoning_content"] = reasoning
        calls = answer.get("tool_calls") or []
        if calls:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "index": i,
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for i, call in enumerate(calls)
            ]
        return message

    def _shows_calls(self, ids: list[int], answer: Message) -> bool:
        """Whether the sampled ids show every call's function name: a call
        the template does not render was not sampled, and must not be
        reported as if a parser had found it."""
        text = self.template.decode(ids)
        return all(c["function"]["name"] in text for c in answer.get("tool_calls") or [])

    def _reasoning_tokens(self, reasoning: str | None) -> int:
        return len(self.model.encode(reasoning)) if reasoning else 0


def choose_tools(
    reading: Reading, tool_choice: Any, single: bool = False
) -> tuple[dict[str, Any], ...]:
    """The functions the model calls in one answer (none: it answers with text).

    Like an agentic model, from what it read in its prompt: it calls the
    first offered tool (every one when the user asked for all at once) when
    the user just spoke, and answers with text after a tool result.
    `tool_choice` is the constraint the request sampled under (SGLang's
    chat route builds it from the request's; on ``/generate`` it is read
    from the sampling parameters): "required" forces a call, a name forces
    that function; `single` (a grammar allowing one call: ``maxItems: 1``)
    keeps the first call only. Raises ValueError when it names a tool the
    prompt does not offer.
    """
    functions = list(reading.tools)
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "required", "none"):
        for f in functions:
            if f["name"] == tool_choice:
                return (f,)
        raise ValueError(f"tool_choice names a function the prompt does not offer: {tool_choice!r}")
    if not functions or tool_choice == "none":
        return ()
    if tool_choice == "required" or not reading.after_tool:
        return tuple(functions) if reading.parallel and not single else (functions[0],)
    return ()


def _schema_value(schema: Any, rng: np.random.Generator) -> Any:
    """A deterministic value that fits a (simple) JSON schema."""
    if not isinstance(schema, dict):
        return None
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[int(rng.integers(0, len(enum)))]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties")
        if not isinstance(props, dict):
            return {}
        return {str(k): _schema_value(v, rng) for k, v in props.items()}
    if kind == "array":
        return [_schema_value(schema.get("items", {"type": "string"}), rng)]
    if kind == "integer":
        return int(rng.integers(0, 10))
    if kind == "number":
        return int(rng.integers(0, 40)) / 4
    if kind == "boolean":
        return bool(rng.integers(0, 2))
    if kind == "string":
        return WORDS[int(rng.integers(0, len(WORDS)))]
    return None
