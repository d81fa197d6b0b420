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
tool-call and reasoning parsers would give it back. Seeded logprobs and the
finish reason complete the sample; the response JSON is `sglang_answer`.

Ids are canonical (they are the tokenisation of the rendered text), so a
re-render of the conversation reproduces them wherever the template does not
rewrite history. Only a completion cut by ``max_tokens`` ends mid-answer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from rollout_session.prompt.messages import Message
from rollout_session.prompt.model_output import CallIds, answer_ids
from rollout_session.prompt.tokenizer import ChatTokenizer

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
    logprobs, and the message SGLang's parsers make of them."""

    ids: list[int]
    logprobs: list[float]
    finish: dict[str, Any]  # SGLang's meta_info.finish_reason
    reasoning_tokens: int
    message: dict[str, Any]


class TextModel:
    """The word list over a real tokenizer (shareable between emulators).

    Building one costs a vocabulary scan (~0.1 s for 129k tokens).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = max(tokenizer.get_vocab().values()) + 1
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

    def words_text(self, rng: np.random.Generator, n: int) -> str:
        picks = rng.integers(0, len(self.words), n)
        ends = rng.integers(0, _SENTENCE_WORDS, n) == 0
        ends[-1] = True
        return " ".join(
            self.words[i] + "." if end else self.words[i]
            for i, end in zip(picks, ends, strict=True)
        )


# Characters of a message's content kept in the context an answer's format
# is derived from: templates look at how a message starts (Qwen3 tells tool
# results sent as user messages by `<tool_response>`), not at all of it.
_CONTEXT_CHARS: Final = 64


def _context(messages: Sequence[Message]) -> list[Message]:
    """The messages from the last user message on, their texts cut short:
    what decides the answer's format, so deriving it costs O(structure of the
    latest exchange), not O(history) or O(prompt length)."""
    start = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), 0)
    context = [
        m
        if m["role"] == "assistant" or not isinstance(m.get("content"), str)
        else {**m, "content": m["content"][:_CONTEXT_CHARS]}
        for m in messages[start:]
    ]
    return context or [{"role": "user", "content": "."}]


# Reasoning markers of the <think> families (Qwen3, DeepSeek-R1, GLM).
_THINK = ("<think>", "</think>")


class Speaker:
    """A `TextModel` speaking one chat template's output format."""

    def __init__(self, model: TextModel, template: ChatTokenizer) -> None:
        self.model = model
        self.template = template
        self.call_ids = CallIds(template)

    def sample(
        self,
        spec: SampleSpec,
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> Sample:
        rng = np.random.default_rng(spec.seed)
        context = _context(messages)
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
        else:
            ids = self._text(rng, spec.target_tokens, context, answer, tools, kwargs)
        stopped = ids[-1] in self.template.stop_ids
        finish: dict[str, Any] = {"type": "stop", "matched": ids[-1]}
        if len(ids) > spec.max_tokens:
            ids = ids[: spec.max_tokens]
            finish = {"type": "length", "length": spec.max_tokens}
        elif not stopped:  # a template whose output names no stop token
            finish = {"type": "stop", "matched": None}
        # Strictly negative, like a real sampler's log-probabilities.
        logprobs = (-np.round(rng.exponential(0.3, len(ids)) + 1e-4, 4)).tolist()
        message = self._message(answer, ids, finish["type"] == "length")
        reasoning = message.get("reasoning_content")
        return Sample(ids, logprobs, finish, self._reasoning_tokens(reasoning), message)

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

    def _reasoning_tokens(self, reasoning: str | None) -> int:
        return len(self.model.encode(reasoning)) if reasoning else 0


def choose_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    messages: list[Any] | None,
    parallel: bool = False,
) -> tuple[dict[str, Any], ...]:
    """The functions the model calls in one answer (none: it answers with text).

    Like an agentic model: call the first offered tool (or the one named by
    ``tool_choice``) when the user just spoke, answer with text after a tool
    result. With ``parallel`` (the request set ``parallel_tool_calls: true``
    itself) it calls every offered tool at once. Without messages (bare
    ``input_ids``) the last speaker is taken to be the user. Raises
    ValueError when ``tool_choice`` names an unknown tool.
    """
    if not tools or tool_choice == "none":
        return ()
    functions: list[dict[str, Any]] = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        for f in functions:
            if f["name"] == name:
                return (f,)
        raise ValueError(f"tool_choice names an unknown function {name!r}")
    last = messages[-1] if messages else None
    last_role = last.get("role") if isinstance(last, dict) else "user"
    if tool_choice == "required" or last_role == "user":
        return tuple(functions) if parallel else (functions[0],)
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
