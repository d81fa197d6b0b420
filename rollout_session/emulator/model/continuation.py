"""Where a prompt that continues the model's own answer splits.

A session server continues a turn a weight update aborted by sending the
turn's prompt ``P`` followed by the tokens ``S[:k]`` the worker had sampled
of its answer ``S``, with the budget less ``k`` (docs/emulator.md#the-model-
continues-its-own-answer). The emulator's model answers such a prompt with
``S[k:]``, so the stitched answer is the uninterrupted one token for token,
on any emulator with the same configuration and seed (nothing is
remembered between requests: a continuation may fail over to another
worker).

The split is read from the prompt's structure: ``P`` ends with a
generation prompt (the template's opening of an assistant turn), so the
candidates are the ends of the last few generation prompts in the prompt.
`GenerationPrompts` knows the template's generation prompts (every thinking
variant the template switches, after a user message and after a tool
result), probed once by rendering. A prompt that *ends* with one is a fresh
turn: no candidate, no extra work. Otherwise the emulator samples the
answer to ``P`` for each candidate (the last first, at most
`MAX_CANDIDATES`) and continues when the rest of the prompt is a proper,
non-empty prefix of it (`Emulator.sample`); failing that it samples the
prompt as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from rollout_session.prompt.messages import Message
from rollout_session.prompt.tokenizer import ChatTokenizer

__all__ = ["MAX_CANDIDATES", "GenerationPrompts"]

# Split points tried per prompt, the last generation prompt first. A
# template may reopen an assistant turn inside one answer (harmony writes
# "<|start|>assistant" between its analysis and its tool call), so the
# prompt's last generation prompt is not always the turn's.
MAX_CANDIDATES: Final = 3
# Template variables that switch thinking on or off in the generation prompt
# (the ones `prompt_reader` reads).
_SWITCHES: Final = ("enable_thinking", "thinking")
_PROBE_TOOL: Final = {
    "type": "function",
    "function": {
        "name": "probe_function",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
    },
}


def _contexts(call_id: str) -> list[tuple[list[Message], list[dict[str, Any]] | None]]:
    """Conversations a generation prompt follows: a user message, a tool result."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "probe_function", "arguments": {"a": "x"}},
    }
    user: Message = {"role": "user", "content": "."}
    return [
        ([user], None),
        ([user], [_PROBE_TOOL]),
        (
            [
                user,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call_id, "content": "."},
            ],
            [_PROBE_TOOL],
        ),
    ]


class GenerationPrompts:
    """The generation prompts of one chat template, as token sequences."""

    def __init__(self, template: ChatTokenizer, call_id: str) -> None:
        source = template.chat_template or ""
        variants: list[dict[str, Any]] = [{}]
        for switch in _SWITCHES:
            if switch in source:
                variants += [{switch: True}, {switch: False}]
        tails: set[tuple[int, ...]] = set()
        for messages, tools in _contexts(call_id):
            for kwargs in variants:
                try:
                    bare = template.render(
                        messages, tools=tools, kwargs=kwargs, add_generation_prompt=False
                    )
                    full = template.render(
                        messages, tools=tools, kwargs=kwargs, add_generation_prompt=True
                    )
                except Exception:  # this context or variant does not render
                    continue
                if full.startswith(bare) and len(full) > len(bare):
                    tails.add(tuple(template.encode(full[len(bare) :])))
                elif full == bare and bare:
                    # No generation prompt (Mistral's [/INST] closes the
                    # user turn): the answer follows the turn's last token.
                    tails.add((template.encode(bare)[-1],))
        self.tails: tuple[tuple[int, ...], ...] = tuple(sorted(t for t in tails if t))
        self._by_last: dict[int, list[tuple[int, ...]]] = {}
        for tail in self.tails:
            self._by_last.setdefault(tail[-1], []).append(tail)

    def _ends_at(self, prompt: Sequence[int], end: int) -> bool:
        """Whether a generation prompt ends at ``prompt[:end]``."""
        for tail in self._by_last.get(prompt[end - 1], ()):
            n = len(tail)
            if n <= end and tuple(prompt[end - n : end]) == tail:
                return True
        return False

    def split_points(self, prompt: Sequence[int]) -> list[int]:
        """Where the prompt's last generation prompts end (at most
        `MAX_CANDIDATES`, the last first), before its end: where the answer
        it continues may start. Empty when the prompt ends with a
        generation prompt (a fresh turn) or holds none."""
        if not prompt or not self._by_last or self._ends_at(prompt, len(prompt)):
            return []
        ids = np.asarray(prompt, dtype=np.int64)
        ends = np.flatnonzero(np.isin(ids[:-1], list(self._by_last))) + 1
        found: list[int] = []
        for end in ends[::-1].tolist():
            if self._ends_at(prompt, end):
                found.append(end)
                if len(found) == MAX_CANDIDATES:
                    break
        return found
