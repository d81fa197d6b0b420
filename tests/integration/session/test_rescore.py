"""POST /sessions/{id}/rescore: a session's exact tokens scored by another
policy (docs/training.md#rescoring), over real HTTP to emulator workers."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Stack

USER = [{"role": "user", "content": "hello"}]

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "no-target": ({"label": "t"}, "target"),
    "empty-target": ({"target": "", "label": "t"}, "target"),
    "no-label": ({"target": "pinned"}, "label"),
    "label-with-space": ({"target": "pinned", "label": "a b"}, "label"),
    "label-too-long": ({"target": "pinned", "label": "x" * 65}, "label"),
    "positions": ({"target": "pinned", "label": "t", "positions": "prompt"}, "positions"),
    "unknown-field": ({"target": "pinned", "label": "t", "temperature": 1}, "temperature"),
    "teacher-without-teachers": ({"target": "teacher", "label": "t"}, "target"),
    "unknown-worker": ({"target": "http://127.0.0.1:9", "label": "t"}, "target"),
}


@pytest.mark.parametrize(("body", "param"), REFUSED.values(), ids=REFUSED.keys())
async def test_a_bad_rescore_request_is_a_400_naming_its_field(
    stack: Stack, body: dict[str, Any], param: str
) -> None:
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    answer = await stack.client.post(f"/sessions/{session_id}/rescore", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert stack.emulator.received == 1  # the turn's only


async def test_pinned_needs_a_turn_first(stack: Stack) -> None:
    session_id = await stack.create()
    answer = await stack.client.post(
        f"/sessions/{session_id}/rescore", json={"target": "pinned", "label": "t"}
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "target"


async def test_an_unknown_session_is_a_404(stack: Stack) -> None:
    answer = await stack.client.post(
        "/sessions/nope/rescore", json={"target": "pinned", "label": "t"}
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "session_not_found"
