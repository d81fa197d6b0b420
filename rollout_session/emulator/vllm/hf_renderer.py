"""vLLM 0.33.0's HF renderer, for the emulator's ``/v1/chat/completions/render``.

Models ``renderers/hf.py`` (``safe_apply_chat_template`` with
``tokenize=False``, whose failure is a 400 with the template's own reason:
``_template_error_reason``) and ``renderers/chat_utils/chat_message.py``
``parse_chat_messages`` for text messages (the "string" content format,
an assistant's tool-call arguments as dicts: ``_postprocess_messages``).
Other content is refused as not modelled.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Final

import jinja2

from rollout_session.emulator.vllm.errors import VllmError, not_modelled, validation_error

__all__ = ["ChatTemplate", "conversation"]

_ROLES: Final = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """The worker's tokenizer and chat template, as vLLM's HF renderer uses them."""

    def __init__(self, tokenizer: Any, chat_template: str) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._vocab: dict[str, int] | None = None

    def render(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> str:
        """``safe_apply_chat_template`` with ``tokenize=False``; a template
        that raises is vLLM's 400 with the template's own reason."""
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                chat_template=self.chat_template,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:
            # safe_apply_chat_template: any failure is a VLLMValidationError
            # carrying the template's reason (_template_error_reason).
            raise VllmError(_template_reason(exc)) from None
        if not isinstance(text, str):
            raise VllmError(f"the chat template returned {type(text).__name__}, not text")
        return text

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_id(self, token: str) -> int | None:
        if self._vocab is None:
            self._vocab = dict(self.tokenizer.get_vocab())
        return self._vocab.get(token)


def _template_reason(exc: BaseException) -> str:
    """``renderers/hf.py`` ``_template_error_reason``: the first jinja error
    in the cause chain, else the exception's text."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


def _text(content: Any, where: str) -> str:
    """A message's content as vLLM's "string" content format renders it: a
    string, null as "", text parts joined with newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                raise not_modelled(f"content parts other than text ({where})", "messages")
        return "\n".join(texts)
    raise not_modelled(f"message content that is not text ({where})", "messages")


def _arguments(value: Any) -> dict[str, Any]:
    """``_postprocess_messages``: a tool call's arguments as the dict
    templates expect (an unreadable or non-object string is ``{}``)."""
    if not value:
        return {}
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
    return parsed if isinstance(parsed, dict) else {}


def conversation(messages: list[Any]) -> list[dict[str, Any]]:
    """``renderers/chat_utils/chat_message.py`` ``parse_chat_messages`` for
    text messages: role, content, an assistant's tool calls (arguments as
    dicts) and reasoning (also as ``reasoning_content``), a tool message's
    ``tool_call_id``, ``name``."""
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise not_modelled(
                f"{where}: it renders messages of role {', '.join(_ROLES)}", "messages"
            )
        assert isinstance(message, dict)
        out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), where)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise not_modelled(f"{where}: tool_calls that are not a list", "messages")
                if calls:
                    out["tool_calls"] = [_tool_call(call) for call in calls]
            reasoning = message.get("reasoning")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise not_modelled(f"{where}: reasoning that is not text", "messages")
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        conversation.append(out)
    return conversation


def _tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise validation_error("assistant tool_calls entries must be objects.", "tool_calls")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise validation_error(
            "chat completions only support assistant tool_calls of type 'function'.",
            "tool_calls",
        )
    out = copy.deepcopy(call)
    out["function"]["arguments"] = _arguments(function.get("arguments"))
    return out
