"""Which of SGLang's parsers a ``sglang-generate`` engine asks, and how.

The answer is parsed by SGLang's own parsers, on the worker that sampled it:
``/separate_reasoning`` then ``/parse_function_call``, in the order the chat
route runs them (``serving_chat._build_chat_response``). Importing SGLang's
parser classes instead would need its GPU stack (``sglang.srt.utils``
imports torch; docs/engines.md#parsing has the evidence).

The routes lack inputs the chat route gives its reasoning parser: its
``force_reasoning`` (``template_manager.force_reasoning or
_get_reasoning_from_request``). For the detectors that use SGLang's base
implementation with no self-label, a text that starts with the think-start
token parses exactly as the forced text (``_detect_and_parse_impl`` strips
every leading start token), so forcing is reproduced by that prefix; the
parsers whose detectors differ are refused at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["LEGACY_TAGS", "REASONING_PARSERS", "TOOL_CALL_MARKERS", "Parsers"]

# Reasoning parsers this engine reproduces: name -> (think-start token, when
# the chat route forces reasoning). The rule is the detector's
# `reasoning_default` (sglang/srt/parser/reasoning_parser.py):
# "always" (DeepSeekR1Detector hard-codes force_reasoning=True),
# "<kwarg>" (forced unless chat_template_kwargs[<kwarg>] is False),
# "explicit_<kwarg>" (forced only if it is True).
REASONING_PARSERS: Final[Mapping[str, tuple[str, str]]] = {
    "deepseek-r1": ("<think>", "always"),
    "qwen3": ("<think>", "enable_thinking"),
    "glm45": ("<think>", "enable_thinking"),
    "deepseek-v3": ("<think>", "explicit_thinking"),
    "kimi_k2": ("<think>", "thinking"),
}
# Reasoning parsers after which the chat route keeps special tokens in the
# text (serving_chat._patch_reasoning_skip_special_tokens).
_KEEP_SPECIAL: Final = frozenset({"apertus2509", "kimi_k3", "inkling", "muse"})
# Tool-call parsers whose required/named tool_choice the chat route
# constrains with a JSON-array schema (their detector's
# supports_structural_tag() is False) and parses as a JSON array
# (serving_chat._process_tool_calls). Every other parser constrains it with
# an xgrammar structural tag.
_JSON_SCHEMA_TOOLS: Final = frozenset(
    {
        "pythonic",
        "glm",
        "glm45",
        "ling3",
        "mimo",
        "minimax-m2",
        "minimax-m3",
        "step3",
        "k2_horizon",
        "gemma4",
        "cohere_command4",
        "dots",
        "gigachat3",
        "gigachat35",
        "poolside_v1",
        "minicpm5",
        "lfm2",
    }
)
# Tool-call parsers under which the chat route constrains every tool turn,
# `auto` included, in a way /generate cannot be sent: glm47's full-assistant
# EBNF (serving_chat._process_messages; `ebnf_full_assistant` is refused by
# /generate's contract gate), inkling's auto structural tag
# (InklingDetector.get_auto_tool_call_structural_tag), and the response
# templates (beam, response_template: configure_response_template_request,
# _set_response_parser_context, the turn grammar).
_REFUSED_TOOL_PARSERS: Final[Mapping[str, str]] = {
    "kimi_k3": "adds a stop string and renders its own prompts",
    "glm47": "constrains every tool turn with a full-assistant EBNF that /generate refuses",
    "inkling": "constrains tool_choice 'auto' with a structural tag",
    "beam": "is a response template (its own detokenization, grammar and parse context)",
    "response_template": "is a response template (its own detokenization, grammar and "
    "parse context)",
}
# Tool-call parsers whose forced (or strict) tool calls the chat route
# constrains with SGLang's legacy structural tag
# (FunctionCallParser.get_legacy_structural_tag), built from each detector's
# structure_info(): begin = BEFORE + name + AFTER, then the arguments, then
# END; TRIGGER starts a call. From sglang/srt/function_call/{qwen25,hermes,
# llama32,mistral,deepseekv3,deepseekv31}_detector.py `structure_info`.
LEGACY_TAGS: Final[Mapping[str, tuple[str, str, str, str]]] = {
    "qwen": ('<tool_call>\n{"name":"', '", "arguments":', "}\n</tool_call>", "<tool_call>"),
    "qwen25": ('<tool_call>\n{"name":"', '", "arguments":', "}\n</tool_call>", "<tool_call>"),
    "hermes": ('<tool_call>{"name":"', '", "arguments":', "}</tool_call>", "<tool_call>"),
    "llama3": ('<|python_tag|>{"name":"', '", "arguments":', "}", "<|python_tag|>"),
    "mistral": ('[TOOL_CALLS] [{"name":"', '", "arguments":', "}]", "[TOOL_CALLS]"),
    "deepseekv3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
        "\n```json\n",
        "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜>",
    ),
    "deepseekv31": (
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁call▁begin｜>",
    ),
}
# What a detector's has_tool_call looks for (sglang/srt/function_call/
# <detector>.py `has_tool_call`, `bot_token`): the chat route parses only a
# text that has it (serving_chat._process_tool_calls), so for these parsers
# a text without it is the answer as it is, and the parse request is not
# sent. Llama's also takes a text that starts with "{".
TOOL_CALL_MARKERS: Final[Mapping[str, str]] = {
    "qwen": "<tool_call>\n",
    "qwen25": "<tool_call>\n",
    "hermes": "<tool_call>",
    "llama3": "<|python_tag|>",
    "mistral": "[TOOL_CALLS",
    "deepseekv3": "<｜tool▁calls▁begin｜>",
    "deepseekv31": "<｜tool▁calls▁begin｜>",
}
# Chat-route tool-call ids other than call_<24 hex> (serving_chat._process_tool_call_id).
_KIMI_IDS: Final = frozenset({"kimi_k2"})


@dataclass(frozen=True, slots=True)
class Parsers:
    """The worker's --tool-call-parser and --reasoning-parser (SGLang's names)."""

    tool_call: str | None = None
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning is not None and self.reasoning not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning parser {self.reasoning!r} is not reproduced by sglang-generate "
                f"(supported: {', '.join(REASONING_PARSERS)}): its detector does not parse a "
                "text prefixed with the think-start token as the chat route's forced parse; "
                "use --engine sglang-chat (docs/engines.md#parsing)"
            )
        refused = _REFUSED_TOOL_PARSERS.get(self.tool_call or "")
        if refused is not None:
            raise ValueError(
                f"tool-call parser {self.tool_call!r} {refused} on SGLang's chat route; "
                "use --engine sglang-chat"
            )

    @property
    def reasoning_needs_special_tokens(self) -> bool:
        return self.reasoning in _KEEP_SPECIAL

    @property
    def tool_call_constrains_natively(self) -> bool:
        """A forced tool_choice is constrained by a structural tag (the
        legacy one for `LEGACY_TAGS`, built here; any other is refused)."""
        return self.tool_call is not None and self.tool_call not in _JSON_SCHEMA_TOOLS

    @property
    def legacy_tag(self) -> tuple[str, str, str, str] | None:
        """The parser's structure_info parts, when its tag is the legacy one."""
        return LEGACY_TAGS.get(self.tool_call or "")

    @property
    def parses_required_as_json(self) -> bool:
        """A forced tool_choice's answer is parsed as a JSON array, not by the detector."""
        return self.tool_call in _JSON_SCHEMA_TOOLS

    def may_call(self, text: str) -> bool:
        """Whether the chat route would parse `text` for tool calls (False
        only where the detector's has_tool_call is known to say no)."""
        marker = TOOL_CALL_MARKERS.get(self.tool_call or "")
        if marker is None:
            return True
        return marker in text or (self.tool_call == "llama3" and text.startswith("{"))

    @property
    def kimi_ids(self) -> bool:
        return self.tool_call in _KIMI_IDS

    def forces_reasoning(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether the chat route parses the answer as starting in reasoning."""
        if self.reasoning is None:
            return False
        rule = REASONING_PARSERS[self.reasoning][1]
        if rule == "always":
            return True
        if rule.startswith("explicit_"):
            return kwargs.get(rule.removeprefix("explicit_")) is True
        return kwargs.get(rule) is not False

    @property
    def think_start(self) -> str:
        return REASONING_PARSERS[self.reasoning][0] if self.reasoning else ""
