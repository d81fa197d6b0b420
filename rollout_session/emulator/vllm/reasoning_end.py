"""Whether a rendered prompt's reasoning has ended, as vLLM 0.33.0's render route says.

Models CP (``entrypoints/openai/chat_completion/protocol.py``)
``resolve_reasoning_ended``: True without ``include_reasoning``, None
without a reasoning parser, else the reasoning parser's
``is_reasoning_end`` over the prompt ids (``reasoning/`` and ``parser/``:
``BaseThinkingReasoningParser``, ``Qwen3Parser``, ``Glm47MoeParser``;
which one reads what: `names.RenderReasoningParser`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from rollout_session.emulator.vllm.chat_protocol import Chat
from rollout_session.emulator.vllm.generate import VllmServer
from rollout_session.emulator.vllm.hf_renderer import ChatTemplate
from rollout_session.emulator.vllm.names import RENDER_REASONING_PARSERS

__all__ = ["reasoning_ended"]

# Reasoning markers and turn boundaries of the parsers modelled
# (parser/qwen3.py THINK_*, TOOL_CALL_START, CHATML_TURN_BOUNDARIES;
# parser/glm47_moe.py GLM_TURN_BOUNDARIES).
_THINK: Final = ("<think>", "</think>")
_TOOL_CALL_START: Final = "<tool_call>"
_BOUNDARIES: Final = {
    "qwen3": ("<|im_start|>", "<|im_end|>"),
    "glm": ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
}


def reasoning_ended(
    chat: Chat,
    server: VllmServer,
    kwargs: Mapping[str, Any],
    ids: Sequence[int],
    template: ChatTemplate,
) -> bool | None:
    """CP ``resolve_reasoning_ended``: True without ``include_reasoning``;
    None without a reasoning parser; else the parser's ``is_reasoning_end``
    over the prompt ids (`vllm.names.RenderReasoningParser`)."""
    if not chat.f["include_reasoning"]:
        return True
    name = server.reasoning_parser
    if name is None:
        return None
    reads = RENDER_REASONING_PARSERS[name].reads
    start, end = (template.token_id(t) for t in _THINK)
    if reads == "think_if_thinking":
        if not (bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))):
            return True  # IdentityReasoningParser
        reads = "think"
    if reads == "think":  # BaseThinkingReasoningParser.is_reasoning_end
        for token in reversed(ids):
            if token == start:
                return False
            if token == end:
                return True
        return False
    if reads == "qwen3":  # Qwen3Parser: thinking unless enable_thinking is off
        thinking = bool(kwargs.get("enable_thinking", True))
    else:  # Glm47MoeParser
        flags = (kwargs.get("thinking"), kwargs.get("enable_thinking"))
        if False in flags and _always_thinks(template.chat_template):
            flags = (None, None)
        thinking = flags == (None, None) or bool(flags[0]) or bool(flags[1])
    if not thinking:  # not waiting for reasoning: ended
        return True
    ends = {template.token_id(_THINK[1]), template.token_id(_TOOL_CALL_START)} - {None}
    bounds = {template.token_id(t) for t in _BOUNDARIES[reads]} - {None}
    for token in reversed(ids):  # ParserEngine.is_reasoning_end
        if token in ends:
            return True
        if token == start or token in bounds:
            return False
    return False


def _always_thinks(chat_template: str) -> bool:
    """``parser/glm47_moe.py`` ``_glm53_always_thinks``."""
    return (
        "[gMASK]<sop>" in chat_template
        and "Reasoning Effort:" in chat_template
        and "enable_thinking" not in chat_template
        and "<tool_call>" in chat_template
        and "<arg_key>" in chat_template
        and "<arg_value>" in chat_template
    )
