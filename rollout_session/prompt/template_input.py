"""Messages as a chat template receives them.

The session stores messages normalised for history matching (`messages.py`);
the template gets them the way SGLang's and vLLM's chat servers hand them to
``apply_chat_template``, because that is what real templates are written
(and tested) against:

- keys whose value is None are absent (SGLang drops them; templates test
  ``'tool_calls' in message`` or ``message.name is defined``);
- an empty ``tool_calls`` list is absent (vLLM drops it; Llama 3 and
  DeepSeek templates treat any present key as a tool-call turn);
- ``content`` None is ``""`` (both servers);
- tool-call ``arguments`` are a dict (HF's convention, what both servers
  pass), except for templates that only accept a JSON string (DeepSeek's
  concatenate it): the style is probed once per template, not looked up by
  model name (`probe_argument_style`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from typing import Any

from .messages import Message

__all__ = ["ArgumentStyle", "probe_argument_style", "template_messages"]


class ArgumentStyle(enum.Enum):
    """How a template wants tool-call arguments."""

    DICT = "dict"  # a JSON object (HF's convention)
    STRING = "string"  # a JSON string, concatenated into the prompt as text


def _call(call: dict[str, Any], style: ArgumentStyle) -> dict[str, Any]:
    fn = call["function"]
    arguments = fn["arguments"]
    if style is ArgumentStyle.STRING and not isinstance(arguments, str):
        # What SGLang's tool-call parsers put in `arguments` (ensure_ascii off).
        arguments = json.dumps(arguments, ensure_ascii=False)
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": fn["name"], "arguments": arguments},
    }
    if call.get("id") is not None:
        out = {"id": call["id"], **out}
    return out


def template_message(message: Message, style: ArgumentStyle) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in message.items():
        if key == "tool_calls":
            if value:
                out[key] = [_call(c, style) for c in value]
        elif key == "content":
            out[key] = "" if value is None else value
        elif value is not None:
            out[key] = value
    return out


def template_messages(messages: Sequence[Message], style: ArgumentStyle) -> list[dict[str, Any]]:
    return [template_message(m, style) for m in messages]


# A call id every template we know accepts (Mistral's want 9 alphanumerics).
_PROBE = (
    {"role": "user", "content": "x"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "a1b2c3d4e", "function": {"name": "probe", "arguments": {"probe": 1}}}
        ],
    },
)


def probe_argument_style(render: Callable[[list[dict[str, Any]]], str]) -> ArgumentStyle:
    """The argument style `render` (a template) accepts: DICT unless only a
    string renders the call as JSON. A template that renders neither (no tool
    support) gets DICT; its error surfaces on the first tool-call request."""
    rendered: dict[ArgumentStyle, str] = {}
    for style in ArgumentStyle:
        try:
            rendered[style] = render(template_messages(_PROBE, style))
        except Exception:  # the template's own failure is the probe's answer
            continue
    as_dict = rendered.get(ArgumentStyle.DICT)
    # A dict printed as a Python repr is not what the model was trained on.
    if as_dict is not None and "{'probe'" not in as_dict:
        return ArgumentStyle.DICT
    if ArgumentStyle.STRING in rendered:
        return ArgumentStyle.STRING
    return ArgumentStyle.DICT
