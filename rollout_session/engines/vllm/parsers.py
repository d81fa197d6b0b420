"""Which of vLLM's parsers a ``vllm`` engine's workers run, and what each
does to a request before sampling.

vLLM parses the answer itself on ``/inference/v1/generate`` with
``output_mode: "derender"`` (renderers/online_derenderer.py): the worker's
own ``--tool-call-parser`` / ``--reasoning-parser`` read the request's
``parse_context``. What the route does *not* do is the chat route's
``Parser.adjust_request`` (renderers/online_renderer.py ``preprocess_chat``):
the changes it makes to the sampling parameters are this module's facts, so
the request module can make them. They are vLLM 0.33's, read from its wheel
(docs/research/vllm-0.33-generate-request.md §3):

- engine-based parsers (parser/engine/parser_engine.py
  ``ParserEngine.adjust_request``) set ``skip_special_tokens = False``
  whenever ``adjust_request`` runs at all — on every request once a
  reasoning parser is configured, else when ``tool_choice`` is not "none";
- some tool parsers set it only for requests with tools and a
  ``tool_choice`` other than "none" (hermes_tool_parser.py
  ``Hermes2ProToolParser.adjust_request``, kimi_k2_tool_parser.py);
- a parser with an xgrammar structural-tag model constrains tool calls with
  a structural tag (parser/abstract_parser.py
  ``DelegatingParser._apply_structural_tag``) for a forced ``tool_choice``,
  a ``strict`` tool, ``parallel_tool_calls: false``, or always when its
  default strict level is FUNCTION (glm45, glm47). That tag is xgrammar's
  JSON, which only vLLM's process builds: such requests are refused.

Parsers not listed here are refused at start-up (the reason names them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["REASONING_PARSERS", "TOOL_CALL_PARSERS", "ToolParser", "VllmParsers"]

SkipSpecial = Literal["always", "with_tools", "never"]


@dataclass(frozen=True, slots=True)
class ToolParser:
    # When its adjust_request sets skip_special_tokens False.
    skip_special: SkipSpecial
    # It has a structural_tag_model (structural_tag_registry.py): with
    # VLLM_ENFORCE_STRICT_TOOL_CALLING (the default) its required/named
    # tool_choice is a structural tag, not the JSON-array schema.
    structural_tag: bool
    # Its default_tool_strict_level is FUNCTION: every request with tools
    # and a tool_choice other than "none" gets the structural tag.
    function_level: bool = False
    # Tool-call ids `functions.NAME:IDX` counted from the history's calls.
    kimi_ids: bool = False


TOOL_CALL_PARSERS: Final[Mapping[str, ToolParser]] = {
    "hermes": ToolParser("with_tools", structural_tag=True),
    "qwen3_json": ToolParser("with_tools", structural_tag=True),
    "llama3_json": ToolParser("never", structural_tag=True),
    "llama4_json": ToolParser("never", structural_tag=True),
    "pythonic": ToolParser("never", structural_tag=False),
    "deepseek_v3": ToolParser("never", structural_tag=True),
    "deepseek_v31": ToolParser("never", structural_tag=True),
    "kimi_k2": ToolParser("with_tools", structural_tag=True, kimi_ids=True),
    "qwen3_coder": ToolParser("always", structural_tag=True),
    "qwen3_xml": ToolParser("always", structural_tag=True),
    "glm45": ToolParser("always", structural_tag=True, function_level=True),
    "glm47": ToolParser("always", structural_tag=True, function_level=True),
}
# Reasoning parsers -> whether they are engine-based (skip_special_tokens
# False on every request). The base ReasoningParser.adjust_request is a no-op.
REASONING_PARSERS: Final[Mapping[str, bool]] = {
    "deepseek_r1": False,
    "deepseek_v3": False,
    "qwen3": True,
    "glm45": True,
    "kimi_k2": True,
}
# Refused with a reason of their own (the generic one says "not reproduced").
_REFUSED: Final[Mapping[str, str]] = {
    "openai": "gpt-oss runs vLLM's Harmony parser, which re-wraps every structured output "
    "as a Harmony structural tag",
    "openai_gptoss": "gpt-oss runs vLLM's Harmony parser, which re-wraps every structured "
    "output as a Harmony structural tag",
    "mistral": "vLLM's Mistral parser constrains requests with a lark grammar built from "
    "the mistral_common tokenizer (parser/mistral.py), even with tool_choice none",
}


def _check(kind: str, name: str | None, known: Mapping[str, Any]) -> None:
    if name is None or name in known:
        return
    reason = _REFUSED.get(name) or "what its adjust_request does to the request is not reproduced"
    raise ValueError(
        f"--engine vllm does not support {kind} {name!r}: {reason}; supported: "
        f"{', '.join(sorted(known))} (docs/engines.md#vllm)"
    )


@dataclass(frozen=True, slots=True)
class VllmParsers:
    """The workers' ``--tool-call-parser`` and ``--reasoning-parser`` (vLLM's
    names; None: the worker runs none). ValueError for one not reproduced."""

    tool_call: str | None = None
    reasoning: str | None = None

    def __post_init__(self) -> None:
        _check("--tool-call-parser", self.tool_call, TOOL_CALL_PARSERS)
        _check("--reasoning-parser", self.reasoning, REASONING_PARSERS)

    @property
    def tool(self) -> ToolParser | None:
        return None if self.tool_call is None else TOOL_CALL_PARSERS[self.tool_call]

    def keeps_special_tokens(self, tools_active: bool) -> bool:
        """Whether adjust_request sets skip_special_tokens False for a request
        (`tools_active`: it has tools and tool_choice is not "none")."""
        if self.reasoning is not None and REASONING_PARSERS[self.reasoning]:
            return True
        tool = self.tool
        if tool is None:
            return False
        adjusts = tools_active or self.reasoning is not None
        if tool.skip_special == "always":
            return adjusts
        return tool.skip_special == "with_tools" and tools_active
