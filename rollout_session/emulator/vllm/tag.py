"""The emulator's stand-in for the structural tag vLLM's tool parsers build.

vLLM 0.33's chat route (and ``/v1/chat/completions/render``) constrains a
tool request with an xgrammar structural tag when its tool parser has a
``structural_tag_model`` and ``resolve_tool_strictness`` keeps the tools
(``parser/abstract_parser.py`` ``DelegatingParser._apply_structural_tag``,
``tool_parsers/structural_tag_registry.py``). That tag is xgrammar's JSON for
one model's tool-call syntax, which the emulator cannot build; its render
route writes this document instead, in the same place
(``structured_outputs.structural_tag``, a JSON string), and its
``/inference/v1/generate`` samples under it:

.. code-block:: json

    {"type": "structural_tag",
     "format": {"type": "rollout_session_emulator_tool_calls",
                "parser": "hermes",
                "tools": ["read_file", "list_dir"],
                "tool_choice": "required",
                "strict": [],
                "stop_after_first": false,
                "response_format": null}}

- ``parser``: the ``--tool-call-parser`` whose syntax the tag would
  constrain (xgrammar's tags are per model format);
- ``tools``: the function names the tag lets the model call
  (``get_structural_tag_tools``: every function tool);
- ``tool_choice``: "auto", "required" or ``{"name": NAME}`` (a named
  function): what the tag forces;
- ``strict``: the tools whose arguments the tag constrains to their schema
  (``function.strict: true``; the emulator's model always writes schema-true
  arguments, so it changes nothing in what it samples);
- ``stop_after_first``: at most one call (``limit_to_single_tool_call``, for
  ``parallel_tool_calls: false``);
- ``response_format``: with "auto", the request's structured output folded
  into the tag (vLLM's ``OrFormat[tools, output]``): ``{"json": schema}`` or
  ``{"json_object": true}``; null otherwise.

Sampling under it (`tag_constraint`): a named function is exactly one call
of it, "required" at least one call (of a tool the prompt offers, as the
model reads it), "auto" as without a constraint (the model has no JSON
mode: an "auto" tag with a response format is answered the same way);
``stop_after_first`` keeps one call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rollout_session.emulator.model.forced_call import ToolConstraint

__all__ = ["TAG_FORMAT", "EmulatorTag", "mint_tag", "read_tag", "tag_constraint"]

TAG_FORMAT: Final = "rollout_session_emulator_tool_calls"
_FORMAT_KEYS: Final = (
    "type",
    "parser",
    "tools",
    "tool_choice",
    "strict",
    "stop_after_first",
    "response_format",
)


@dataclass(frozen=True)
class EmulatorTag:
    """A tag the emulator's render route minted."""

    parser: str
    tools: tuple[str, ...]
    tool_choice: str  # "auto" | "required" | "named"
    named: str | None
    strict: tuple[str, ...]
    stop_after_first: bool
    response_format: Mapping[str, Any] | None


def mint_tag(
    *,
    parser: str,
    tools: Sequence[str],
    tool_choice: str | None,
    named: str | None,
    strict: Sequence[str],
    stop_after_first: bool,
    response_format: Mapping[str, Any] | None,
) -> str:
    """The tag's JSON text (``json.dumps`` of the document, as vLLM writes
    ``json.dumps(structural_tag.model_dump())``)."""
    choice: Any = {"name": named} if named is not None else tool_choice
    return json.dumps(
        {
            "type": "structural_tag",
            "format": {
                "type": TAG_FORMAT,
                "parser": parser,
                "tools": list(tools),
                "tool_choice": choice,
                "strict": list(strict),
                "stop_after_first": stop_after_first,
                "response_format": None if response_format is None else dict(response_format),
            },
        }
    )


def _names(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def read_tag(text: Any) -> EmulatorTag | None:
    """The tag ``text`` is, if the emulator minted it (exact shape); None
    for anything else (xgrammar's tags, SGLang's, malformed text)."""
    if not isinstance(text, str):
        return None
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(document, dict) or set(document) != {"type", "format"}:
        return None
    form = document["format"]
    if document["type"] != "structural_tag" or not isinstance(form, dict):
        return None
    if set(form) != set(_FORMAT_KEYS) or form["type"] != TAG_FORMAT:
        return None
    parser, choice, single, fmt = (
        form["parser"],
        form["tool_choice"],
        form["stop_after_first"],
        form["response_format"],
    )
    tools, strict = _names(form["tools"]), _names(form["strict"])
    if not isinstance(parser, str) or tools is None or not tools or strict is None:
        return None
    if not isinstance(single, bool) or not (fmt is None or isinstance(fmt, dict)):
        return None
    named: str | None = None
    if isinstance(choice, dict):
        name = choice.get("name")
        if set(choice) != {"name"} or not isinstance(name, str) or name not in tools:
            return None
        choice, named = "named", name
    elif choice not in ("auto", "required"):
        return None
    if fmt is not None and (choice != "auto" or not _is_format(fmt)):
        return None
    return EmulatorTag(parser, tools, choice, named, strict, single, fmt)


def _is_format(fmt: Mapping[str, Any]) -> bool:
    """A response format a tag may carry: ``{"json": schema}`` or
    ``{"json_object": true}``."""
    if set(fmt) == {"json_object"}:
        return fmt["json_object"] is True
    return set(fmt) == {"json"} and isinstance(fmt["json"], dict | bool)


def tag_constraint(tag: EmulatorTag) -> ToolConstraint:
    """What the model samples under ``tag`` (module docstring)."""
    if tag.named is not None:
        return ToolConstraint(tag.named, single=True)
    return ToolConstraint(tag.tool_choice, single=tag.stop_after_first)
