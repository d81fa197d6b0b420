"""The chat route's bad-input table (test_api.BAD_CHAT), mirrored for the
Responses route, on the session route and at the root (`X-Session-ID`):
every malformed request is a 4xx in OpenAI's error shape, never a 5xx,
reaches no worker, and leaves the trajectory as it was.
(test_anthropic_messages.BAD_INPUTS is the same table for Messages.)"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.conftest import Stack
from tests.integration.protocols.test_sdk import MODEL

USER = "What does main.py print?"
_OK: dict[str, Any] = {"model": MODEL, "input": USER}
_FUNCTION = {"type": "function", "name": "read_file", "parameters": {"type": "object"}}
_CALL = {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"}


def _with(**fields: Any) -> bytes:
    return orjson.dumps({**_OK, **fields})


def _without(name: str) -> bytes:
    return orjson.dumps({k: v for k, v in _OK.items() if k != name})


BAD_INPUTS: list[tuple[str, bytes]] = [
    # The chat route's rows, as the Responses API spells them.
    ("not-json", b"{"),
    ("not-object", b"[1]"),
    ("empty-body", b""),
    ("no-input", _without("input")),
    ("input-int", _with(input=5)),
    ("input-empty", _with(input=[])),
    ("input-object", _with(input={"role": "user", "content": "x"})),
    ("unknown-role", _with(input=[{"role": "wizard", "content": "x"}])),
    ("content-int", _with(input=[{"role": "user", "content": 5}])),
    ("image-part", _with(input=[{"role": "user", "content": [{"type": "input_image"}]}])),
    ("n-2", _with(n=2)),
    ("temperature-str", _with(temperature="hot")),
    ("temperature-nan", _with().replace(b"}", b', "temperature": NaN}')),
    ("temperature-high", _with(temperature=9.5)),
    ("top-p-high", _with(top_p=1.5)),
    ("max-output-tokens-0", _with(max_output_tokens=0)),
    ("max-output-tokens-bool", _with(max_output_tokens=True)),
    ("max-output-tokens-str", _with(max_output_tokens="8")),
    ("stop-int", _with(stop=3)),
    ("tools-not-list", _with(tools={"a": 1})),
    ("tool-no-name", _with(tools=[{"type": "function"}])),
    ("tool-not-object", _with(tools=["read_file"])),
    ("stream-str", _with(stream="yes")),
    ("call-args-int", _with(input=[{"role": "user", "content": USER}, {**_CALL, "arguments": 3}])),
    # The Responses API's own.
    ("item-not-object", _with(input=["hi"])),
    ("item-unknown-type", _with(input=[{"type": "video"}])),
    ("call-no-name", _with(input=[{"role": "user", "content": USER}, {**_CALL, "name": None}])),
    ("output-no-call-id", _with(input=[{"type": "function_call_output", "output": "x"}])),
    ("output-int", _with(input=[{"type": "function_call_output", "call_id": "c1", "output": 1}])),
    ("instructions-int", _with(instructions=1)),
    ("previous-int", _with(previous_response_id=1)),
    ("previous-unknown", _with(previous_response_id="resp_nope")),
    ("builtin-tool", _with(tools=[{"type": "web_search"}])),
    ("tool-choice-builtin", _with(tools=[_FUNCTION], tool_choice={"type": "file_search"})),
    ("tool-choice-int", _with(tool_choice=1)),
    ("text-format-unknown", _with(text={"format": {"type": "xml"}})),
    ("text-not-object", _with(text="json")),
    ("metadata-string", _with(metadata="x")),
    ("background", _with(background=True)),
    ("conversation", _with(conversation="conv_1")),
    ("file-input", _with(input=[{"role": "user", "content": [{"type": "input_file"}]}])),
    ("template-kwargs-list", _with(chat_template_kwargs=[1])),
]


# The root route is the session route once the edge has read the session
# header (session_routing.py): the body is parsed by the same code, so a few
# rows of each kind show it answers in the same shape.
ROOT_ROWS = ("not-json", "not-object", "input-object", "tool-no-name", "builtin-tool")
CASES = [("session", n, b) for n, b in BAD_INPUTS] + [
    ("root", n, b) for n, b in BAD_INPUTS if n in ROOT_ROWS
]


@pytest.mark.parametrize(
    ("route", "name", "body"), CASES, ids=[f"{n}-{route}-route" for route, n, _ in CASES]
)
async def test_bad_input_is_a_4xx_in_openais_shape(
    stack: Stack, route: str, name: str, body: bytes
) -> None:
    session_id = await stack.create()
    path = f"/sessions/{session_id}/v1/responses"
    first = await stack.client.post(path, content=_with())
    assert first.status_code == 200, first.text
    before = (await stack.client.get(f"/sessions/{session_id}/trajectory")).content
    received = stack.emulator.received
    if route == "root":
        path, headers = "/v1/responses", {"X-Session-ID": session_id}
    else:
        headers = {}
    response = await stack.client.post(
        path, content=body, headers={"content-type": "application/json", **headers}
    )
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] and error["type"], error
    assert stack.emulator.received == received
    assert (await stack.client.get(f"/sessions/{session_id}/trajectory")).content == before
    assert stack.ctx.registry.get(session_id).slot is None
