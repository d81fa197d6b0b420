"""The tool call a grammar forces on the model, engine-neutral.

A grammar that constrains decoding to a JSON array of tool calls (SGLang's
``get_json_schema_constraint`` in ``srt/function_call/utils.py``, vLLM's
``get_json_schema_from_tools`` in ``entrypoints/openai/chat_completion/
protocol.py`` write the same shape) or a structural tag forces the model to
call a tool; `ToolConstraint` is what the model (`generation.choose_tools`)
honours, whichever engine's request carried the grammar.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ToolConstraint", "array_tool_constraint"]


@dataclass(frozen=True)
class ToolConstraint:
    """The tool call a grammar forces: ``choice`` "auto" (none forced),
    "required" (at least one of the offered tools) or a function's name;
    ``single``: at most one call (``maxItems: 1``, ``parallel_tool_calls``
    false)."""

    choice: str = "auto"
    single: bool = False


def array_tool_constraint(schema: Any) -> ToolConstraint | None:
    """The tool call a JSON-array tool schema forces (SGLang's
    ``get_json_schema_constraint``, vLLM's ``get_json_schema_from_tools``
    write the same shape): ``items.anyOf`` for "required", a one-name enum
    for a named tool; ``maxItems`` 1 for one call only. None: not that shape."""
    if not (isinstance(schema, dict) and schema.get("type") == "array"):
        return None
    items = schema.get("items")
    if not isinstance(items, dict):
        return None
    single = schema.get("maxItems") == 1
    if isinstance(items.get("anyOf"), list):
        return ToolConstraint("required", single)
    props = items.get("properties")
    name = props.get("name") if isinstance(props, dict) else None
    enum = name.get("enum") if isinstance(name, dict) else None
    if isinstance(enum, list) and len(enum) == 1 and isinstance(enum[0], str):
        return ToolConstraint(enum[0], single)
    return None
