"""The emulator's fake language model: what it samples for one completion.

Owns what the model does for one completion: prompt rendering with the chat
template, the model's choice to call a tool, deterministic text (words, tool
calls, ``<think>`` blocks) turned into *canonical* token ids with the real
tokenizer, seeded logprobs and the finish reason. What SGLang makes of it
(the parsed message, the routed-experts blob, the response JSON) is
`sglang_answer`.

Canonical ids matter: the session server stores the sampled ids and later
checks them against the chat template's rendering of the conversation, so
``encode(decode(ids)) == ids`` must hold. Every word of the word list is a
single token both with and without a leading space (checked when the model is
built), so cutting a word sequence after any token cuts at a word boundary and
the prefix is still canonical. Only a completion cut inside a tool call or a
``<think>`` block (by ``max_tokens``, or a forced length shorter than the
block) can be non-canonical; exact length wins there.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from .sglang_answer import parse_tool_calls, split_reasoning

__all__ = [
    "WORDS",
    "Sample",
    "SampleSpec",
    "TextModel",
    "choose_tool",
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

    ``tool`` is the OpenAI ``function`` object to call (``None``: answer with
    text). ``target_tokens`` forces the number of sampled tokens including the
    end token (text answers only). ``max_tokens`` is the hard budget: a longer
    completion is cut and finishes with ``length``.
    """

    seed: int
    max_tokens: int
    target_tokens: int | None = None
    tool: dict[str, Any] | None = None
    reasoning: bool = False


@dataclass(frozen=True)
class Sample:
    """One completion: sampled ids (with the end token when it stopped) and logprobs."""

    ids: list[int]
    logprobs: list[float]
    finish: dict[str, Any]  # SGLang's meta_info.finish_reason
    reasoning_tokens: int


class TextModel:
    """Deterministic "sampling" over a real tokenizer.

    Building one costs a vocabulary scan (~0.1 s for 129k tokens); emulators
    that use the same tokenizer can share one.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id (the end-of-turn token)")
        self.eos_id = int(tokenizer.eos_token_id)
        self.vocab_size: int = max(tokenizer.get_vocab().values()) + 1
        self.words: tuple[str, ...] = tuple(
            w for w in WORDS if len(self.encode(w)) == 1 and len(self.encode(" " + w)) == 1
        )
        if len(self.words) < _MIN_WORDS:
            raise ValueError(
                f"only {len(self.words)} words of the emulator's word list are single tokens "
                f"in this tokenizer; need {_MIN_WORDS}"
            )
        think_end = tokenizer.convert_tokens_to_ids("</think>")
        self._think_end_id: int | None = think_end if isinstance(think_end, int) else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
    ) -> list[int]:
        """Prompt ids of a conversation: chat template + generation prompt, tokenized.

        Text-part lists (``[{"type": "text", "text": ...}]``) are joined into
        strings first, as SGLang does. Raises ValueError when the template
        cannot render the request.
        """
        conversation = [
            {
                **m,
                "content": "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict)),
            }
            if isinstance(m.get("content"), list)
            else m
            for m in messages
        ]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                **template_kwargs,
            )
        except Exception as exc:
            raise ValueError(f"cannot render the chat template: {exc}") from exc
        return self.encode(text)

    def sample(self, spec: SampleSpec) -> Sample:
        rng = np.random.default_rng(spec.seed)
        if spec.tool is not None:
            prefix = self._think_block(rng, int(rng.integers(4, 11))) if spec.reasoning else ""
            ids = self.encode(prefix + tool_call_text(spec.tool, rng))
        else:
            target = spec.target_tokens or int(rng.integers(*_DEFAULT_LENGTH))
            body = target - 1  # the end token is the last sampled token
            prefix = self._think_block(rng, max(1, body // 3)) if spec.reasoning else ""
            ids = self._fill(rng, prefix, body)
        ids.append(self.eos_id)
        finish: dict[str, Any] = {"type": "stop", "matched": self.eos_id}
        if len(ids) > spec.max_tokens:
            ids = ids[: spec.max_tokens]
            finish = {"type": "length", "length": spec.max_tokens}
        # Strictly negative, like a real sampler's log-probabilities.
        logprobs = (-np.round(rng.exponential(0.3, len(ids)) + 1e-4, 4)).tolist()
        return Sample(ids, logprobs, finish, self._reasoning_tokens(ids, spec.reasoning))

    def _words(self, rng: np.random.Generator, n: int) -> str:
        picks = rng.integers(0, len(self.words), n)
        ends = rng.integers(0, _SENTENCE_WORDS, n) == 0
        ends[-1] = True
        return " ".join(
            self.words[i] + "." if end else self.words[i]
            for i, end in zip(picks, ends, strict=True)
        )

    def _think_block(self, rng: np.random.Generator, n_words: int) -> str:
        return f"<think>\n{self._words(rng, n_words)}\n</think>\n\n"

    def _fill(self, rng: np.random.Generator, prefix: str, n_tokens: int) -> list[int]:
        """Exactly ``n_tokens`` ids of ``prefix`` followed by words, cut after a word."""
        n_words = max(1, n_tokens)
        while True:
            ids = self.encode(prefix + self._words(rng, n_words))
            if len(ids) >= n_tokens:
                return ids[:n_tokens]
            # Only a tokenizer that merges whole words into one token gets here.
            n_words *= 2

    def _reasoning_tokens(self, ids: list[int], reasoning: bool) -> int:
        if not reasoning:
            return 0
        if self._think_end_id is not None and self._think_end_id in ids:
            return ids.index(self._think_end_id) + 1
        return len(ids)

    def parse(self, sample: Sample, *, reasoning: bool, tools: bool, seed: int) -> dict[str, Any]:
        """The assistant message SGLang builds from the sampled ids."""
        text = self.decode(sample.ids)  # the end token is special: decode skips it
        message: dict[str, Any] = {"role": "assistant"}
        if reasoning:
            reasoning_text, text = split_reasoning(text)
            message["reasoning_content"] = reasoning_text
        calls = parse_tool_calls(text, seed) if tools else []
        if calls:
            text = text[: text.index("<tool_call>")].strip()
        message["content"] = text
        if calls:
            message["tool_calls"] = calls
        return message


def choose_tool(
    tools: list[dict[str, Any]] | None, tool_choice: Any, messages: list[Any] | None
) -> dict[str, Any] | None:
    """The function the model calls, or None to answer with text.

    Like an agentic model: call the first offered tool (or the one named by
    ``tool_choice``) when the user just spoke, answer with text after a tool
    result. Without messages (bare ``input_ids``) the last speaker is taken to
    be the user. Raises ValueError when ``tool_choice`` names an unknown tool.
    """
    if not tools or tool_choice == "none":
        return None
    functions: list[dict[str, Any]] = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        for f in functions:
            if f["name"] == name:
                return f
        raise ValueError(f"tool_choice names an unknown function {name!r}")
    last = messages[-1] if messages else None
    last_role = last.get("role") if isinstance(last, dict) else "user"
    if tool_choice == "required" or last_role == "user":
        return functions[0]
    return None


def tool_call_text(function: dict[str, Any], rng: np.random.Generator) -> str:
    """The Qwen/Hermes tool-call text the chat templates render for an assistant call."""
    args = _schema_value({"type": "object", **function.get("parameters", {})}, rng)
    arguments = json.dumps(args, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>'


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
