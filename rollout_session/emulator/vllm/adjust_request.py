"""What vLLM 0.33.0's parsers' ``adjust_request`` does to a rendered chat request.

Models ``renderers/online_renderer.py`` ``preprocess_chat``'s tail
(``parser/abstract_parser.py`` ``DelegatingParser.adjust_request``: the
reasoning parser's, then ``_apply_structural_tag``, then the tool
parser's ``adjust_request``, whose JSON schema is
``tool_parsers/utils.py`` ``get_json_schema_from_tools``) and
``entrypoints/generate/base/protocol.py``
``structured_outputs_from_response_format`` (`extract`). The structural
tag xgrammar would build is the emulator's own (`tag.mint_tag`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from rollout_session.emulator.vllm.chat_protocol import Chat
from rollout_session.emulator.vllm.errors import VllmError, not_modelled, validation_error
from rollout_session.emulator.vllm.generate import VllmServer
from rollout_session.emulator.vllm.names import (
    RENDER_REASONING_PARSERS,
    RENDER_TOOL_PARSERS,
    RenderToolParser,
)
from rollout_session.emulator.vllm.sampling import check_one_constraint
from rollout_session.emulator.vllm.tag import mint_tag

__all__ = ["NO_STRUCTURED_OUTPUTS", "Adjusted", "adjust", "extract", "response_format"]

# StructuredOutputsParams' public fields (SP), in declaration order.
NO_STRUCTURED_OUTPUTS: Final[Mapping[str, Any]] = {
    "json": None,
    "regex": None,
    "choice": None,
    "grammar": None,
    "json_object": None,
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
}


def response_format(value: Any) -> dict[str, Any] | None:
    """The ``response_format`` shapes modelled: ``text``, ``json_object``,
    ``json_schema`` with ``{name, schema}``."""
    if value is None:
        return None
    if isinstance(value, dict):
        kind = value.get("type")
        if kind in ("text", "json_object"):
            return {"type": kind}
        spec = value.get("json_schema")
        if (
            kind == "json_schema"
            and isinstance(spec, dict)
            and isinstance(spec.get("name"), str)
            and (spec.get("schema") is None or isinstance(spec["schema"], dict))
        ):
            return {"type": kind, "schema": spec.get("schema")}
        if kind == "structural_tag":
            raise not_modelled("response_format structural_tag", "response_format")
    raise not_modelled(
        "a response_format other than text, json_object or json_schema {name, schema}",
        "response_format",
    )


def extract(
    structured: Mapping[str, Any] | None, fmt: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """``structured_outputs_from_response_format``: the response format
    overrides the request's structured outputs (``dataclasses.replace``)."""
    if fmt is None or fmt["type"] == "text":
        return None if structured is None else dict(structured)
    override = {"json_object": True} if fmt["type"] == "json_object" else {"json": fmt["schema"]}
    params = {**(structured or NO_STRUCTURED_OUTPUTS), **override}
    check_one_constraint(params)
    return params


def _tool_params(tool: Mapping[str, Any]) -> dict[str, Any]:
    """``_params_or_empty_object``."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def _json_schema(chat: Chat, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``tool_parsers/utils.py`` ``get_json_schema_from_tools`` for a chat
    request: a named function's parameters, or the "required" array (its
    tools' ``$defs`` moved to the top: popped from the request's tools)."""
    named = chat.named
    if named is not None:
        tool = next(t for t in tools if t["function"]["name"] == named)  # checked in stage 1
        return _tool_params(tool)
    if chat.tool_choice != "required":
        return None
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _tool_params(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if chat.f["parallel_tool_calls"] is False:
        schema["maxItems"] = 1
    defs: dict[str, Any] = {}
    for tool in tools:
        params = tool["function"].get("parameters")
        if params is None:
            continue
        found = params.pop("$defs", {})
        name = tool["function"]["name"]
        if not isinstance(found, dict):
            raise validation_error(
                f"`$defs` in the parameters of tool '{name}' must be an object, got "
                f"{type(found).__name__}.",
                "tools",
            )
        for key, value in found.items():
            if key in defs and defs[key] != value:
                raise validation_error(
                    f"Tool definition '{key}' has multiple schemas, which is not supported.",
                    "tools",
                )
            defs[key] = value
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class Adjusted:
    """What ``adjust_request`` left in the request."""

    structured_outputs: dict[str, Any] | None
    response_format: dict[str, Any] | None
    skip_special_tokens: bool | None


def adjust(chat: Chat, server: VllmServer, structured: Any, fmt: Any) -> Adjusted:
    """OR ``preprocess_chat``'s tail: the parsers' ``adjust_request``
    (``DelegatingParser.adjust_request``: the reasoning parser's, then
    ``_apply_structural_tag``, then the tool parser's)."""
    out = Adjusted(structured, fmt, chat.f["skip_special_tokens"])
    tool_name, reasoning_name = server.tool_call_parser, server.reasoning_parser
    choice = chat.tool_choice
    if (tool_name is None and reasoning_name is None) or (
        reasoning_name is None and choice == "none"
    ):
        return out
    if reasoning_name is not None and RENDER_REASONING_PARSERS[reasoning_name].engine:
        out.skip_special_tokens = False
    if tool_name is None:
        return out
    parser = RENDER_TOOL_PARSERS[tool_name]
    tools = chat.f["tools"]
    if tools and (choice in ("auto", "required") or chat.named is not None):
        tag = _structural_tag(chat, tool_name, parser, tools, extract(structured, fmt))
        if tag is not None:
            out.structured_outputs = {**NO_STRUCTURED_OUTPUTS, "structural_tag": tag}
            out.response_format = None
    # The tool parser's adjust_request.
    if (
        tools
        and parser.json_schema
        and not (
            out.structured_outputs and out.structured_outputs.get("structural_tag") is not None
        )
    ):
        schema = _json_schema(chat, tools)
        if schema is not None:
            out.structured_outputs = {**NO_STRUCTURED_OUTPUTS, "json": schema}
            out.response_format = None
    if parser.skip_special == "always" or (
        parser.skip_special == "with_tools" and tools and choice != "none"
    ):
        out.skip_special_tokens = False
    return out


def _structural_tag(
    chat: Chat,
    parser_name: str,
    parser: RenderToolParser,
    tools: list[dict[str, Any]],
    structured: dict[str, Any] | None,
) -> str | None:
    """``DelegatingParser._apply_structural_tag`` with the emulator's tag:
    whether ``resolve_tool_strictness`` keeps the tools (not for "auto" at
    strict level AUTO without a strict tool; ``parallel_tool_calls: false``
    raises the level to FUNCTION unless "auto" has a structured output;
    glm45/glm47 default to FUNCTION), and "auto"'s structured output folded
    in (``OrFormat``)."""
    if not parser.structural_tag:
        return None
    is_auto = chat.tool_choice == "auto"
    single = chat.f["parallel_tool_calls"] is False
    function_level = parser.function_level or (single and not (is_auto and structured is not None))
    strict = [t["function"]["name"] for t in tools if t["function"].get("strict") is True]
    if is_auto and not function_level and not strict:
        return None
    fmt: dict[str, Any] | None = None
    if is_auto and structured is not None:
        fmt = _tag_format(structured)
    return mint_tag(
        parser=parser_name,
        tools=[t["function"]["name"] for t in tools],
        tool_choice=None if chat.named is not None else str(chat.tool_choice),
        named=chat.named,
        strict=strict,
        stop_after_first=single,
        response_format=fmt,
    )


def _tag_format(structured: Mapping[str, Any]) -> dict[str, Any]:
    """``structured_outputs_to_format`` for the outputs modelled."""
    if structured.get("json_object"):
        return {"json_object": True}
    schema = structured.get("json")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise VllmError(f"structured_outputs.json is not JSON: {exc}") from None
    return {"json": schema}
