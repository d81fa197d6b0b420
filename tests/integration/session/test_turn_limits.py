"""Token limits end to end: the session cap is hard, and a prompt that cannot
fit is refused having tokenised about the room's worth of it."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.emulator.worker import EmulatorConfig
from rollout_session.prompt.bounded import PIECE_CHARS
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
@pytest.mark.parametrize("turn", ["first", "later"], ids=["first", "later"])
async def test_an_oversize_prompt_is_refused_for_the_cost_of_its_room(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch, limit: dict[str, int], turn: str
) -> None:
    """8 MiB of text, whatever the vocabulary far over 4,096 tokens, in a
    first turn's user message or a later turn's tool result: refused after
    tokenising a few pieces of it (`prompt.bounded`), nothing committed."""
    stack = await make_stack(**limit)
    session_id = await stack.create()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read the file."}]
    if turn == "later":
        response = await stack.chat(session_id, messages=messages)
        assert response.status_code == 200, response.text
        messages.append(response.json()["choices"][0]["message"])
    before = (await stack.trajectory(session_id))["token_ids"]
    tokenizer = stack.ctx.ready_tokenizer
    encode, tokenised = tokenizer.encode, []

    def counting(text: str) -> list[int]:
        tokenised.append(len(text))
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", counting)
    text = "lorem ipsum dolor sit amet " * (8 * 2**20 // 27)
    messages.append({"role": "user", "content": text})
    response = await stack.chat(session_id, messages=messages)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "at least" in error["message"]
    assert sum(tokenised) <= 2 * PIECE_CHARS < len(text) // 50
    assert stack.emulator.received == (turn == "later")
    assert (await stack.trajectory(session_id))["token_ids"] == before
