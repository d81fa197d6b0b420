"""sglang-generate over HTTP: what it cannot reproduce is a 400 in the chat
route's error shape, nothing is sent or committed, and the connection
serves the next turn."""

from __future__ import annotations

from rollout_session.emulator import EmulatorConfig
from tests.conftest import TOOLS, StackFactory

USER = [{"role": "user", "content": "hello"}]


async def test_a_forced_call_under_a_native_tag_parser_is_refused(
    make_stack: StackFactory,
) -> None:
    # The parser is read from the worker's /server_info.
    stack = await make_stack(emulator=EmulatorConfig(tool_call_parser="kimi_k2"), engine="auto")
    session_id = await stack.create()
    refused = await stack.chat(session_id, messages=USER, tools=TOOLS, tool_choice="required")
    assert refused.status_code == 400
    error = refused.json()
    assert error["object"] == "error" and error["code"] == 400
    assert "structural tag" in error["message"] and "sglang-chat" in error["message"]
    assert not [r for r in stack.emulator.requests if r.route == "generate"]
    assert (await stack.trajectory(session_id))["turns"] == []
    # The same connection takes the next turn.
    ok = await stack.chat(session_id, messages=USER, max_tokens=8)
    assert ok.status_code == 200, ok.text
    assert len((await stack.trajectory(session_id))["turns"]) == 1
