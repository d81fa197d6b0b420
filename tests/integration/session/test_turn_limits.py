"""A turn's limits end to end. Tokens: the session cap is hard, and a prompt
that cannot fit is refused having tokenised about the room's worth of it.
Beyond tokens: the text a session keeps (--max-session-mb), the messages a
request carries (--max-messages, counted before any is built), and how deep
tool-call arguments nest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_session.emulator.worker import EmulatorConfig
from rollout_session.http.protocols import messages_codec, responses_codec
from rollout_session.prompt.bounded import PIECE_CHARS
from rollout_session.turn import request as chat_request_module
from rollout_session.turn.request import MAX_ARGUMENT_DEPTH
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


# -- beyond tokens -------------------------------------------------------------


def _episode(task: str, reasoning: str) -> list[dict[str, Any]]:
    """A request that starts a new segment (its first message is new) and
    carries, in a past answer, reasoning the chat template never renders."""
    return [
        {"role": "user", "content": task},
        {"role": "assistant", "content": "ok", "reasoning_content": reasoning},
        {"role": "user", "content": "go on"},
    ]


async def test_text_no_template_renders_counts_against_the_session_budget(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    """Each request starts a segment whose history holds 300 KB of reasoning
    the template drops: a few tokens each, but every byte kept (and
    journaled). Past --max-session-mb (1): 400 session_too_large before any
    worker, nothing stored; the last segment still extends; the journal holds
    what memory holds, and a restart finds the same bytes."""
    stack = await make_stack(max_session_mb=1, journal=str(tmp_path), journal_fsync="always")
    session_id = await stack.create()
    reasoning = "x" * 300_000
    for i in range(3):
        response = await stack.chat(session_id, messages=_episode(f"task {i}", reasoning))
        assert response.status_code == 200, response.text[:300]
    answer = response.json()["choices"][0]["message"]
    before = await stack.trajectory(session_id, schema=3)
    assert before["num_segments"] == 3
    refused = await stack.chat(session_id, messages=_episode("task 3", reasoning))
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("session_too_large", "messages")
    assert "--max-session-mb" in error["message"]
    assert stack.emulator.received == 3
    assert await stack.trajectory(session_id, schema=3) == before
    session = stack.ctx.registry.get(session_id)
    kept = session.stored_bytes()
    assert 900_000 < kept <= 2**20
    # Its last segment goes on: an extension adds a few bytes.
    extended = [*_episode("task 2", reasoning), answer, {"role": "user", "content": "more"}]
    assert (await stack.chat(session_id, messages=extended)).status_code == 200
    kept = session.stored_bytes()
    assert kept <= 2**20
    journal = sum(f.stat().st_size for f in tmp_path.glob("*.log"))  # noqa: ASYNC240
    assert journal < 2**20 + 64 * 1024  # the kept text, plus tokens and record framing
    await stack.server.aclose()
    again = await make_stack(journal=str(tmp_path))
    assert again.ctx.registry.get(session_id).stored_bytes() == kept


async def test_metadata_over_the_session_budget_is_refused_at_create(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(max_session_mb=0.5)
    response = await stack.client.post("/sessions", json={"metadata": {"note": "x" * 600_000}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("session_too_large", "metadata")
    assert len(stack.ctx.registry) == 0
    assert (await stack.client.post("/sessions", json={"metadata": {"n": 1}})).status_code == 201


_TINY = {"role": "user", "content": "a"}
# Each protocol's route, its body with `count` tiny messages, and where its
# error names them.
_MANY: dict[str, tuple[str, Any, str]] = {
    "chat": ("v1/chat/completions", lambda n: {"messages": [_TINY] * n}, "messages"),
    "responses": ("v1/responses", lambda n: {"input": [_TINY] * n}, "input"),
    "messages": (
        "v1/messages",
        lambda n: {"model": "m", "max_tokens": 8, "messages": [_TINY] * n},
        "messages",
    ),
    "tool-calls": (
        "v1/chat/completions",
        lambda n: {
            "messages": [
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}] * n,
                },
            ]
        },
        "messages",
    ),
}


@pytest.mark.parametrize(("path", "body", "field"), _MANY.values(), ids=_MANY.keys())
async def test_a_body_of_more_messages_than_the_limit_is_refused_before_it_is_parsed(
    make_stack: StackFactory,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    body: Any,
    field: str,
) -> None:
    """--max-messages (100 here): one more message (content part, tool call)
    is refused for its number, counted before any protocol parses the body
    (no route's JSON parse runs), in the route's own error shape."""
    stack = await make_stack(max_messages=100)
    session_id = await stack.create()
    parsed: list[bytes] = []

    def parse(raw: bytes) -> dict[str, Any]:
        parsed.append(raw)
        data: dict[str, Any] = orjson.loads(raw)
        return data

    for module in (chat_request_module, responses_codec, messages_codec):
        monkeypatch.setattr(module, "parse_json_object", parse)
    url = f"/sessions/{session_id}/{path}"
    refused = await stack.client.post(url, json=body(101))
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert "(--max-messages)" in error["message"]
    if path == "v1/messages":  # Anthropic's shape
        assert refused.json()["type"] == "error"
        assert error["type"] == "invalid_request_error"
    else:
        assert (error["code"], error["param"]) == ("invalid_request", field)
    assert parsed == []
    assert stack.emulator.received == 0
    # At the limit, the request is a turn.
    assert (await stack.client.post(url, json=body(100))).status_code == 200
    assert len(parsed) == 1


def _nested(depth: int) -> str:
    """Tool-call arguments, as JSON text, `depth` objects deep."""
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize(
    ("arguments", "refused"),
    [
        (_nested(5000), True),
        (orjson.loads(_nested(MAX_ARGUMENT_DEPTH + 1)), True),
        (_nested(MAX_ARGUMENT_DEPTH), False),
        ('{"text": "' + "[" * 5000 + '"}', False),
    ],
    ids=["string-5000-deep", "object-past-the-limit", "at-the-limit", "brackets-in-a-string"],
)
async def test_tool_call_arguments_nested_too_deep_are_refused_before_the_worker(
    make_stack: StackFactory, arguments: Any, refused: bool
) -> None:
    """Arguments nested past MAX_ARGUMENT_DEPTH (an object, or a JSON string
    this server's own parse gives up on at 1,024 levels) are a 400 naming
    them: the worker would parse them again, and crash."""
    stack = await make_stack()
    session_id = await stack.create()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    response = await stack.chat(session_id, messages=messages)
    if not refused:
        assert response.status_code == 200, response.text[:300]
        return
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    param = "messages[1].tool_calls[0].function.arguments"
    assert (error["code"], error["param"]) == ("invalid_request", param)
    assert f"deeper than {MAX_ARGUMENT_DEPTH}" in error["message"]
    assert stack.emulator.received == 0
