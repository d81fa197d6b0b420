"""What a model trained on a chat template samples for a given answer.

A model's answer is the template's rendering of that assistant message as
the *last* message (reasoning, tool-call markup and all), after the
generation prompt, up to and including its first stop token. Where the
template writes no stop token for the last turn (GLM), the model stops on
the token that starts what follows (GLM's ``<|user|>`` or
``<|observation|>``). `check-template` simulates models with it, and the
SGLang emulator samples with it, so both speak each family's own format
without a per-family table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from .junction import shared_prefix
from .messages import Message

if TYPE_CHECKING:
    from .tokenizer import ChatTokenizer

__all__ = ["CallIds", "answer_ids"]

_THINK_OPEN: Final = "<think>"
_THINK_CLOSE: Final = "</think>"


class CallIds:
    """Tool-call ids the template accepts: SGLang's own (``call_`` + hex),
    else the 9 alphanumerics Mistral's templates demand. Probed once."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self._short = False
        for short in (False, True):
            call_id = self._make(0, short)
            probe: list[Message] = [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": call_id, "function": {"name": "f", "arguments": {"a": 1}}}
                    ],
                },
                {"role": "tool", "tool_call_id": call_id, "content": "y"},
            ]
            try:
                tok.render(probe, tools=None, kwargs={}, add_generation_prompt=True)
            except Exception:  # the template refuses this id format: try the next
                continue
            self._short = short
            return

    @staticmethod
    def _make(n: int, short: bool) -> str:
        digest = hashlib.blake2b(str(n).encode(), digest_size=12).hexdigest()
        return digest[:9] if short else f"call_{digest}"

    def __call__(self, n: int) -> str:
        """The id of the n-th call."""
        return self._make(n, self._short)


def _output_ids(
    tok: ChatTokenizer,
    messages: Sequence[Message],
    answer: Message,
    tools: list[Any] | None,
    kwargs: Mapping[str, Any],
) -> list[int]:
    prompt = tok.first_turn(messages, tools=tools, kwargs=kwargs)
    full = tok.encode(
        tok.render([*messages, answer], tools=tools, kwargs=kwargs, add_generation_prompt=False)
    )
    common = shared_prefix(prompt, full)
    opened, output = prompt[common:], full[common:]
    if output[: len(opened)] == opened:
        return output[len(opened) :]
    if "".join(tok.decode_pieces(opened)).rstrip().endswith(_THINK_OPEN):
        # The prompt opens a reasoning block the last-turn rendering does not
        # show: the model writes its reasoning and closes it, where the
        # rendering does not close it already (DeepSeek-V3.1 writes
        # `</think>` before the content, R1 nothing).
        reasoning = answer.get("reasoning_content") or ""
        closes = "".join(tok.decode_pieces(output[:1])) == _THINK_CLOSE
        return tok.encode(reasoning if closes else f"{reasoning}\n{_THINK_CLOSE}\n\n") + output
    # The prompt pre-fills what the last-turn rendering does not show (an
    # empty reasoning block): the model continues after it.
    return output


def answer_ids(
    tok: ChatTokenizer,
    messages: Sequence[Message],
    answer: Message,
    *,
    tools: list[Any] | None,
    kwargs: Mapping[str, Any],
) -> list[int]:
    """The ids a model sampling `answer` after `messages` produces, ending
    with its stop token: the first in its rendering, else the one that starts
    the message the model predicts next (a tool result after tool calls, else
    a user message)."""
    ids = _output_ids(tok, messages, answer, tools, kwargs)
    for i, token in enumerate(ids):
        if token in tok.stop_ids:
            return ids[: i + 1]
    if not tok.stop_ids:
        raise ValueError("the tokenizer names no stop token (eos or generation_config.json)")
    calls = answer.get("tool_calls") or []
    follow: Message = (
        {"role": "tool", "tool_call_id": calls[0].get("id"), "content": "."}
        if calls
        else {"role": "user", "content": "."}
    )
    # Without reasoning, the answer renders the same as the last message and
    # in history, so what follows it is where the next message starts.
    plain = {k: v for k, v in answer.items() if k != "reasoning_content"}
    last = tok.render([*messages, plain], tools=tools, kwargs=kwargs, add_generation_prompt=False)
    after = tok.render(
        [*messages, plain, follow], tools=tools, kwargs=kwargs, add_generation_prompt=False
    )
    then = tok.encode(after[len(last) :]) if after.startswith(last) else []
    if then and then[0] in tok.stop_ids:
        return [*ids, then[0]]
    return [*ids, tok.eos_id if tok.eos_id in tok.stop_ids else min(tok.stop_ids)]
