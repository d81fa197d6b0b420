"""Token limits end to end: the session cap is hard, and a prompt that cannot
fit is refused before it is rendered."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.testing.emulator import EmulatorConfig
from tests.conftest import StackFactory


async def test_the_session_cap_holds_without_max_tokens(make_stack: StackFactory) -> None:
    # The worker would sample 5,000 tokens if nothing stopped it.
    stack = await make_stack(
        max_session_tokens=300, emulator=EmulatorConfig(completion_tokens=5000)
    )
    session_id = await stack.create()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Write a long essay."}]
    response = await stack.chat(session_id, messages=messages)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    sent = stack.emulator.requests[-1].body
    doc = await stack.trajectory(session_id)
    assert len(doc["token_ids"]) == 300
    assert sent["max_tokens"] == 300 - doc["turns"][0]["completion_start"]
    # The cap is reached: the next turn is refused before the worker.
    messages += [response.json()["choices"][0]["message"], {"role": "user", "content": "More."}]
    response = await stack.chat(session_id, messages=messages)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert stack.emulator.received == 1


@pytest.mark.parametrize(
    "limit", [{"context_length": 4096}, {"max_session_tokens": 4096}], ids=["context", "cap"]
)
async def test_an_oversize_prompt_is_refused_before_it_is_rendered(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch, limit: dict[str, int]
) -> None:
    stack = await make_stack(**limit)
    session_id = await stack.create()
    tokenizer = stack.ctx.ready_tokenizer

    def never(*args: object, **kwargs: object) -> list[int]:
        raise AssertionError("an oversize prompt was rendered")

    monkeypatch.setattr(tokenizer, "first_turn", never)
    # 8 MiB of words: far over 4,096 tokens whatever the vocabulary.
    text = "lorem ipsum dolor sit amet " * (8 * 2**20 // 27)
    response = await stack.chat(session_id, messages=[{"role": "user", "content": text}])
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "at least" in error["message"]
    assert stack.emulator.received == 0
    assert (await stack.trajectory(session_id))["token_ids"] == []
