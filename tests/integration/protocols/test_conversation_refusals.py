"""What a conversation must hold, over HTTP on each protocol's route
(docs/api.md#what-a-conversation-must-hold): each refusal is a 400 in the
route's own error shape naming the field as its agent wrote it, reaches no
worker, commits nothing, and the same keep-alive connection takes the next
request; what agents legitimately send is a turn. The rules themselves are
tested in tests/unit/prompt/test_messages.py and tests/unit/turn/test_request.py;
here, that each route applies them and names the field in its own terms."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from tests.conftest import Stack
from tests.integration.protocols.test_sdk import MODEL
from tests.integration.raw_http import RawConnection

USER = "What does main.py print?"
USER_MESSAGE = {"role": "user", "content": USER}
FUNCTION = {"type": "function", "name": "read_file", "parameters": {"type": "object"}}
CHAT_CALL = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
CALL_ITEM = {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"}
TOOL_USE = {"type": "tool_use", "id": "t1", "name": "read_file", "input": {}}

Body = dict[str, Any]


@dataclass(frozen=True)
class Route:
    path: str
    first: Body  # a turn that commits before the refused request
    anthropic: bool = False  # Anthropic's error shape (it has no `param`)

    def error(self, doc: dict[str, Any]) -> dict[str, Any]:
        if self.anthropic:
            assert doc["type"] == "error", doc
        error: dict[str, Any] = doc["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
        return error


CHAT = Route("/v1/chat/completions", {"messages": [USER_MESSAGE]})
# The first Response calls a tool, for the rows that answer it by previous_response_id.
RESPONSES = Route(
    "/v1/responses",
    {"model": MODEL, "input": USER, "tools": [FUNCTION], "tool_choice": "required"},
)
MESSAGES = Route(
    "/v1/messages",
    {"model": MODEL, "max_tokens": 16, "messages": [USER_MESSAGE]},
    anthropic=True,
)

# (id, route, the body given the first turn's answer, the field named or None: 200)
Row = tuple[str, Route, Callable[[Body], Body], str | None]


def chat(*messages: Body, **fields: Any) -> Callable[[Body], Body]:
    return lambda _first: {"messages": [USER_MESSAGE, *messages], **fields}


def responses(*items: Body, **fields: Any) -> Callable[[Body], Body]:
    return lambda _first: {"model": MODEL, "input": [USER_MESSAGE, *items], **fields}


def after_first(*items: Body) -> Callable[[Body], Body]:
    """Input after the first Response, named by previous_response_id."""
    return lambda first: {"model": MODEL, "input": list(items), "previous_response_id": first["id"]}


def answering_first(call_id: str | None = None) -> Callable[[Body], Body]:
    """An output for the first Response's call (which tool_choice forced),
    or for `call_id`."""

    def body(first: Body) -> Body:
        [call] = [item for item in first["output"] if item["type"] == "function_call"]
        output = {"type": "function_call_output", "call_id": call_id or call["call_id"]}
        return after_first({**output, "output": "x"})(first)

    return body


def messages(*turns: Body, **fields: Any) -> Callable[[Body], Body]:
    return lambda _first: {**MESSAGES.first, "messages": [USER_MESSAGE, *turns], **fields}


def result(tool_use_id: str) -> Body:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id}]}


ANSWER_CALLING = {"role": "assistant", "content": None, "tool_calls": [CHAT_CALL]}
ROWS: list[Row] = [
    ("chat-user-no-content", CHAT, chat({"role": "user"}), "messages[1].content"),
    ("chat-tool-without-call", CHAT, chat({"role": "tool", "content": "x"}),
     "messages[1].tool_call_id"),
    ("chat-tool-unknown-id", CHAT,
     chat(ANSWER_CALLING, {"role": "tool", "tool_call_id": "c9", "content": "x"}),
     "messages[2].tool_call_id"),
    ("chat-assistant-empty", CHAT, chat({"role": "assistant"}, {"role": "user", "content": "?"}),
     "messages[1].content"),
    ("chat-unanswered-call", CHAT, chat(ANSWER_CALLING, {"role": "user", "content": "?"}),
     "messages[1].tool_calls[0]"),
    ("chat-required-no-tools", CHAT, chat(tool_choice="required"), "tool_choice"),
    ("chat-top-logprobs-no-logprobs", CHAT, chat(top_logprobs=5), "top_logprobs"),
    ("chat-parameters-string", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     "tools[0].function.parameters"),
    # The model's empty answer, sent back as it came.
    ("chat-empty-answer-accepted", CHAT,
     chat({"role": "assistant", "content": ""}, {"role": "user", "content": "?"}), None),
    ("responses-output-unknown-call", RESPONSES,
     responses(CALL_ITEM, {"type": "function_call_output", "call_id": "c9", "output": "x"}),
     "input[2].call_id"),
    ("responses-output-without-call", RESPONSES,
     responses({"type": "function_call_output", "call_id": "c1", "output": "x"}),
     "input[1].call_id"),
    ("responses-unanswered-call", RESPONSES, responses(CALL_ITEM, {"role": "user", "content": "?"}),
     "input[1]"),
    ("responses-previous-unknown-call", RESPONSES, answering_first("c9"), "input[0].call_id"),
    ("responses-previous-unanswered", RESPONSES, after_first({"role": "user", "content": "?"}),
     "input[0]"),
    ("responses-top-logprobs-100", RESPONSES, responses(top_logprobs=100), "top_logprobs"),
    ("responses-include-int", RESPONSES, responses(include=5), "include"),
    ("responses-parameters-string", RESPONSES,
     responses(tools=[{**FUNCTION, "parameters": "x"}]), "tools[0].parameters"),
    ("responses-required-no-tools", RESPONSES, responses(tool_choice="required"), "tool_choice"),
    # The output answers the previous Response's call: checked with its history.
    ("responses-previous-answered-accepted", RESPONSES, answering_first(), None),
    ("messages-result-unknown-id", MESSAGES,
     messages({"role": "assistant", "content": [TOOL_USE]}, result("t9")),
     "messages[2].content[0].tool_use_id"),
    ("messages-result-without-use", MESSAGES, messages(result("t1")),
     "messages[1].content[0].tool_use_id"),
    ("messages-unanswered-use", MESSAGES,
     messages({"role": "assistant", "content": [TOOL_USE]}, {"role": "user", "content": "?"}),
     "messages[1].content[0]"),
    ("messages-input-schema-string", MESSAGES,
     messages(tools=[{"name": "f", "input_schema": "x"}]), "tools[0].input_schema"),
    ("messages-any-no-tools", MESSAGES, messages(tool_choice={"type": "any"}), "tool_choice"),
    # What Claude Code sends: a system message within the conversation.
    ("messages-system-message-accepted", MESSAGES,
     messages({"role": "system", "content": "Be brief."}), None),
]  # fmt: skip


ROUTES = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}


# One session per route, its rows in turn on one keep-alive connection: a
# server per row would cost more than the rows (the accepted rows, which
# commit, come last).
@pytest.mark.parametrize("name", list(ROUTES), ids=list(ROUTES))
async def test_refused_naming_the_field_and_nothing_committed(stack: Stack, name: str) -> None:
    route = ROUTES[name]
    session_id = await stack.create()
    path, trajectory = f"/sessions/{session_id}{route.path}", f"/sessions/{session_id}/trajectory"
    first = await stack.client.post(path, json=route.first)
    assert first.status_code == 200, first.text
    before = (await stack.client.get(trajectory)).json()
    connection = await RawConnection.open(stack.url)
    try:
        for row, _, body, param in [r for r in ROWS if r[1] is route]:
            received = stack.emulator.received
            answer = await connection.request(
                "POST", path, {"content-type": "application/json"}, orjson.dumps(body(first.json()))
            )
            if param is None:
                assert answer.status == 200, (row, answer.body)
                continue
            assert (answer.status, answer.closes) == (400, False), (row, answer.body)
            error = route.error(orjson.loads(answer.body))
            assert param in error["message"], (row, error)
            assert route.anthropic or error["param"] == param, (row, error)
            assert stack.emulator.received == received, row
            # The same connection takes the next request, and nothing was committed.
            after = await connection.request("GET", trajectory)
            assert after.status == 200 and orjson.loads(after.body) == before, row
    finally:
        await connection.aclose()
