"""What the emulator's model reads from its prompt ids.

A real engine samples from the prompt ids alone, on every route: the chat
route's ``messages`` and ``tools`` reach only its parsers and constraints.
The emulator's model does the same, so ``/v1/chat/completions`` and
``/generate`` sample the same completion for the same ids and sampling
parameters (docs/emulator.md#the-model-reads-its-prompt). From the decoded
prompt it reads:

- the tools on offer, as templates write them: JSON function objects (Qwen,
  Llama, GLM, Kimi, Mistral), harmony's TypeScript namespace (gpt-oss) or
  Qwen3-Coder's XML. A template that writes no tools (DeepSeek's) offers
  none: its model answers in text unless the system prompt lists them;
- whether a tool result is the last message, by the template's own opening
  of a tool message (probed once by rendering), against that of a user
  message;
- the template's thinking switch (``enable_thinking``, ``thinking``), by
  which variant's generation prompt the prompt ends with;
- whether the user asked for every tool at once (:data:`ALL_TOOLS` in the
  last user message): the model then calls them in parallel.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rollout_session.prompt.messages import Message
from rollout_session.prompt.tokenizer import ChatTokenizer

__all__ = ["ALL_TOOLS", "PromptReader", "Reading"]

# In the last user message: the model calls every offered tool at once.
ALL_TOOLS: Final = "use all tools at once"

_PROBE_TOOL: Final = "probe_function"
_USER_PROBE: Final = "USERPROBE"
_TOOL_PROBE: Final = "TOOLPROBE"
_PREVIOUS: Final = "PREVPROBE"  # in the message before a probe
# Template variables that switch thinking on or off in the generation prompt.
_SWITCHES: Final = ("enable_thinking", "thinking")
_TAIL_CACHE: Final = 256  # contexts whose generation prompts are kept
_JSON_START = re.compile(r"\{\s*\"")
_TS_FUNCTION = re.compile(r"(?:// ([^\n]*)\n)?type (\w+) = \((?:_: \{\n(.*?)\n\})?\) => any;", re.S)
_TS_FIELD = re.compile(r"^(\w+)(\?)?: (\w+)", re.M)
_XML_FUNCTION = re.compile(
    r"<function>\n<name>([^<]+)</name>(?:\n<description>([^<]*)</description>)?(.*?)</function>",
    re.S,
)
_XML_PARAMETER = re.compile(r"<parameter>\n<name>([^<]+)</name>\n<type>([^<]+)</type>")


@dataclass(frozen=True)
class Reading:
    """What decides an answer's shape, as read from the prompt."""

    tools: tuple[dict[str, Any], ...]  # OpenAI `function` objects, in offer order
    after_tool: bool  # the last message is a tool result
    kwargs: Mapping[str, Any]  # the thinking switch the generation prompt shows
    parallel: bool  # the user asked for every tool at once

    def context(self, call_id: str) -> list[Message]:
        """A conversation with the prompt's last exchange, to render the answer after."""
        user: Message = {"role": "user", "content": "."}
        if not (self.after_tool and self.tools):
            return [user]
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": self.tools[0]["name"], "arguments": {}},
        }
        return [
            user,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": "."},
        ]

    @property
    def openai_tools(self) -> list[dict[str, Any]] | None:
        return [{"type": "function", "function": f} for f in self.tools] or None


def _function(value: Any) -> dict[str, Any] | None:
    """`value` as a tool definition's function object, or None."""
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        value = value["function"]
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    params = value.get("parameters", {})
    # A definition's parameters are a JSON schema; Llama's tool *calls* also
    # say "parameters", with the argument values.
    if not isinstance(params, dict) or (params and "type" not in params):
        return None
    return value


def _json_tools(text: str) -> list[dict[str, Any]]:
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    pos = 0
    while (match := _JSON_START.search(text, pos)) is not None:
        try:
            value, end = decoder.raw_decode(text, match.start())
        except ValueError:
            pos = match.start() + 1
            continue
        function = _function(value)
        if function is not None:
            found.append(function)
            pos = end
        else:
            pos = match.start() + 1
    return found


def _schema(fields: Sequence[tuple[str, str, bool]]) -> dict[str, Any]:
    kinds = {"string": "string", "number": "number", "integer": "integer", "boolean": "boolean"}
    return {
        "type": "object",
        "properties": {name: {"type": kinds.get(kind, "string")} for name, kind, _ in fields},
        "required": [name for name, _, required in fields if required],
    }


def _typescript_tools(text: str) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "description": description,
            "parameters": _schema(
                [(f, kind, not opt) for f, opt, kind in _TS_FIELD.findall(body or "")]
            ),
        }
        for description, name, body in _TS_FUNCTION.findall(text)
    ]


def _xml_tools(text: str) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "description": description,
            "parameters": _schema([(p, kind, True) for p, kind in _XML_PARAMETER.findall(body)]),
        }
        for name, description, body in _XML_FUNCTION.findall(text)
    ]


def read_tools(text: str) -> tuple[dict[str, Any], ...]:
    """The tool definitions `text` shows, each name once, in order."""
    seen: dict[str, dict[str, Any]] = {}
    for function in (*_json_tools(text), *_typescript_tools(text), *_xml_tools(text)):
        seen.setdefault(function["name"], function)
    return tuple(seen.values())


class PromptReader:
    """Reads prompts rendered by one chat template (probed once)."""

    def __init__(self, template: ChatTokenizer, call_id: str) -> None:
        self._tok = template
        self._call_id = call_id
        self._tail_cache: dict[tuple[str, bool], list[tuple[list[int], Mapping[str, Any]]]] = {}
        self._specials = [p for p in template.decode_pieces(sorted(template.special_ids)) if p]
        self._user_opens = self._opening(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": _PREVIOUS}],
            {"role": "user", "content": _USER_PROBE},
            _USER_PROBE,
        )
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": _PROBE_TOOL, "arguments": {"a": _PREVIOUS}},
        }
        self._tool_opens = self._opening(
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
            ],
            {"role": "tool", "tool_call_id": call_id, "content": _TOOL_PROBE},
            _TOOL_PROBE,
        )
        source = template.chat_template or ""
        switches = [s for s in _SWITCHES if s in source]
        self._variants: list[dict[str, Any]] = [{}]
        for switch in switches:
            self._variants += [{switch: True}, {switch: False}]

    def _opening(
        self, before: list[Message], message: Message, probe: str
    ) -> re.Pattern[str] | None:
        """What the template writes before a `message`'s content (the probe
        tool name matching any name), or None if it cannot be told."""
        try:
            head = self._tok.render(before, tools=None, kwargs={}, add_generation_prompt=False)
            full = self._tok.render(
                [*before, message], tools=None, kwargs={}, add_generation_prompt=False
            )
        except Exception:  # the template refuses the probe: cannot tell
            return None
        common = 0
        for a, b in zip(head, full, strict=False):
            if a != b:
                break
            common += 1
        opening = full[common : full.index(probe)] if probe in full else ""
        if _PREVIOUS in opening:
            # The template renders the previous message differently when it
            # is last (Qwen3): start after the special token that ends it.
            rest = opening[opening.rindex(_PREVIOUS) + len(_PREVIOUS) :]
            ends = [rest.index(t) + len(t) for t in self._specials if t in rest]
            opening = rest[min(ends) :] if ends else ""
        if not opening.strip():
            return None
        pattern = re.escape(opening).replace(re.escape(_PROBE_TOOL), r"[^\s<>\"]+")
        return re.compile(pattern)

    @staticmethod
    def _last_end(pattern: re.Pattern[str] | None, text: str) -> int:
        if pattern is None:
            return -1
        ends = [m.end() for m in pattern.finditer(text)]
        return ends[-1] if ends else -1

    def read(self, prompt_ids: Sequence[int]) -> Reading:
        text = self._tok.decode(prompt_ids)
        tools = read_tools(text)
        user_end = self._last_end(self._user_opens, text)
        after_tool = self._last_end(self._tool_opens, text) > user_end
        parallel = user_end >= 0 and ALL_TOOLS in text[user_end:]
        return Reading(tools, after_tool, self._switch(prompt_ids, tools, after_tool), parallel)

    def _switch(
        self, prompt_ids: Sequence[int], tools: tuple[dict[str, Any], ...], after_tool: bool
    ) -> Mapping[str, Any]:
        """The variant whose generation prompt ends the prompt (the longest such)."""
        best: tuple[int, Mapping[str, Any]] = (-1, {})
        for tail, kwargs in self._tails(tools, after_tool):
            n = len(tail)
            if (
                n > best[0]
                and n <= len(prompt_ids)
                and list(prompt_ids[len(prompt_ids) - n :]) == tail
            ):
                best = (n, kwargs)
        return best[1]

    def _tails(
        self, tools: tuple[dict[str, Any], ...], after_tool: bool
    ) -> list[tuple[list[int], Mapping[str, Any]]]:
        """Each variant's generation prompt after this context (cached)."""
        key = (json.dumps(tools, sort_keys=True), after_tool)
        cached = self._tail_cache.get(key)
        if cached is not None:
            return cached
        context = Reading(tools, after_tool, {}, False).context(self._call_id)
        openai_tools = [{"type": "function", "function": f} for f in tools] or None
        tails: list[tuple[list[int], Mapping[str, Any]]] = []
        for kwargs in self._variants if len(self._variants) > 1 else []:
            try:
                bare = self._tok.render(
                    context, tools=openai_tools, kwargs=kwargs, add_generation_prompt=False
                )
                full = self._tok.render(
                    context, tools=openai_tools, kwargs=kwargs, add_generation_prompt=True
                )
            except Exception:  # this variant cannot render the context
                continue
            if full.startswith(bare):
                tails.append((self._tok.encode(full[len(bare) :]), kwargs))
        if len(self._tail_cache) >= _TAIL_CACHE:
            self._tail_cache.clear()
        self._tail_cache[key] = tails
        return tails
