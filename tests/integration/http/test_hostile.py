"""Property test: hostile or malformed requests across all routes never get a
5xx and never change a committed trajectory.

The default profile sends 2,400 requests (240 examples × 10); a longer run:
``scripts/fuzz`` (``--hypothesis-profile=long``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import Stack

PROTECTED = "protected-session"
OTHER = "other-session"
KEY = "k3y"

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["user", "assistant", "tool", "system", "", "\u0000", "🚀" * 10]),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=30,
)


def dumps(value: Any) -> bytes:
    # stdlib json: it writes integers past 64 bits, which orjson refuses to.
    return json.dumps(value).encode()


def deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"messages": [value]}
    return value


message = st.fixed_dictionaries(
    {"role": json_value | st.sampled_from(["user", "tool", "assistant", "wizard"])},
    optional={
        "content": json_value,
        "tool_calls": json_value,
        "reasoning_content": json_value,
        "tool_call_id": json_value,
        "name": json_value,
    },
)
# Chat bodies that look almost right: each carries at least one defect.
almost_chat = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4) | json_value},
    optional={
        "n": st.integers(2, 10) | json_value,
        "max_tokens": st.integers(max_value=0) | st.floats() | json_value,
        "temperature": st.floats(min_value=2.01) | st.text(),
        "tools": json_value,
        "stream": json_value,
        "stop": st.integers() | st.lists(st.integers(), min_size=1),
        "seed": st.floats(allow_nan=False) | st.text(),
    },
).filter(lambda body: not _maybe_valid(body))


def _maybe_valid(body: dict[str, Any]) -> bool:
    """Could the server accept this as a turn? Those are not hostile input."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return False
    ok_role = all(isinstance(m, dict) and m.get("role") in ("user", "tool", "system") for m in msgs)
    return ok_role and set(body) == {"messages"}


# Responses bodies that look almost right: each carries a defect it cannot
# be accepted with, whatever else Hypothesis puts in.
response_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "x"])
        | json_value,
        "role": json_value,
        "content": json_value,
        "call_id": json_value,
        "name": json_value,
        "arguments": json_value,
        "output": json_value,
    },
)
defect = st.one_of(
    st.fixed_dictionaries({"tools": st.just([{"type": "web_search"}])}),
    st.fixed_dictionaries({"background": st.just(True)}),
    st.fixed_dictionaries({"previous_response_id": st.text(max_size=20) | json_value}),
    st.fixed_dictionaries({"input": st.just([]) | st.integers() | st.just(None)}),
    st.fixed_dictionaries({"stream": st.integers() | st.text(min_size=1)}),
)
almost_responses = st.tuples(
    st.fixed_dictionaries(
        {"input": st.lists(response_item, max_size=4) | json_value},
        optional={
            "instructions": json_value,
            "tools": json_value,
            "tool_choice": json_value,
            "text": json_value,
            "max_output_tokens": st.integers(max_value=0) | json_value,
        },
    ),
    defect,
).map(lambda pair: {**pair[0], **pair[1]})

# Messages (Anthropic) bodies that look almost right, each with a defect.
anthropic_block = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"])
        | json_value,
        "text": json_value,
        "id": json_value,
        "name": json_value,
        "input": json_value,
        "tool_use_id": json_value,
        "content": json_value,
        "thinking": json_value,
    },
)
anthropic_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]) | json_value},
    optional={"content": st.lists(anthropic_block, max_size=3) | json_value},
)
messages_defect: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.fixed_dictionaries({"tools": st.just([{"type": "web_search_20250305", "name": "w"}])}),
    st.fixed_dictionaries({"mcp_servers": st.just([{"type": "url", "url": "x", "name": "x"}])}),
    st.fixed_dictionaries({"messages": st.just([]) | st.integers() | st.just(None)}),
    st.fixed_dictionaries({"stream": st.integers() | st.text(min_size=1)}),
    st.fixed_dictionaries(
        {"messages": st.just([{"role": "user", "content": [{"type": "image", "source": {}}]}])}
    ),
)
almost_messages = st.tuples(
    st.fixed_dictionaries(
        {"messages": st.lists(anthropic_message, max_size=4) | json_value},
        optional={
            "model": json_value,
            "max_tokens": st.integers(max_value=0) | json_value,
            "system": json_value,
            "tools": json_value,
            "tool_choice": json_value,
            "thinking": json_value,
            "stop_sequences": json_value,
        },
    ),
    messages_defect,
).map(lambda pair: {**pair[0], **pair[1]})

session_ids = st.sampled_from([PROTECTED, OTHER, "missing", "../etc", "a" * 300, "%00", "ü"])
body = st.one_of(
    json_value.map(dumps),
    almost_chat.map(dumps),
    almost_responses.map(dumps),
    almost_messages.map(dumps),
    st.binary(max_size=64),
    st.integers(1, 120).map(lambda d: dumps(deep(d)) if d < 100 else b"[" * d),
    st.just(b"{" * 5000),
)
route = st.sampled_from(
    [
        ("POST", "/sessions"),
        ("GET", "/sessions"),
        ("GET", "/sessions/{sid}"),
        ("GET", "/sessions/{sid}/trajectory"),
        ("POST", "/sessions/{sid}/v1/chat/completions"),
        ("POST", "/sessions/{sid}/v1/responses"),
        ("POST", "/v1/responses"),
        ("POST", "/sessions/{sid}/v1/messages"),
        ("POST", "/sessions/{sid}/v1/messages/count_tokens"),
        ("POST", "/v1/messages"),
        ("GET", "/sessions/{sid}/v1/models"),
        ("DELETE", "/sessions/{sid}"),
        ("GET", "/workers"),
        ("POST", "/workers"),
        ("DELETE", "/workers"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("PUT", "/sessions/{sid}"),
        ("GET", "/no/such/route"),
    ]
)
query = st.dictionaries(
    st.sampled_from(["state", "limit", "after", "include", "format", "url"]),
    st.text(max_size=20) | st.sampled_from(["-1", "0", "99999999999", "sample", "open"]),
    max_size=3,
)
auth = st.sampled_from([None, f"Bearer {KEY}", "Bearer wrong", "Basic abc", f"bearer {KEY}"])
request = st.tuples(route, session_ids, body, query, auth)


async def send(client: httpx.AsyncClient, spec: Any) -> httpx.Response:
    (method, path), sid, content, params, key = spec
    if method == "DELETE" and sid == PROTECTED:
        sid = OTHER  # collecting the protected session would be legitimate
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = key
    return await client.request(
        method, path.format(sid=sid), content=content, params=params, headers=headers
    )


async def test_hostile_requests_never_5xx_nor_change_history(make_stack: Any) -> None:
    stack: Stack = await make_stack(api_key=KEY, max_body_mb=1)
    stack.client.headers["authorization"] = f"Bearer {KEY}"
    for sid in (PROTECTED, OTHER):
        assert (await stack.client.post("/sessions", json={"session_id": sid})).status_code == 201
        turn = await stack.chat(sid, messages=[{"role": "user", "content": "hello"}])
        assert turn.status_code == 200
    before = (await stack.client.get(f"/sessions/{PROTECTED}/trajectory")).content
    statuses: list[int] = []
    client = httpx.AsyncClient(base_url=stack.url, timeout=30)

    # Hypothesis drives a synchronous test: it runs in a worker thread and
    # hands each request to this trio loop, where the servers live.
    @given(st.lists(request, min_size=5, max_size=5))
    def run(specs: list[Any]) -> None:
        for spec in specs:
            response = trio.from_thread.run(send, client, spec)
            statuses.append(response.status_code)
            assert response.status_code < 500, (spec, response.text)
            if response.status_code >= 400:
                doc = response.json()
                error = doc["error"]
                assert error["code"] and error["message"]
                (_, path), sid = spec[0], spec[1]
                if "/v1/messages" in path and "/" not in sid:  # Anthropic's error shape
                    assert doc["type"] == "error" and error["type"], (spec, doc)

    try:
        await trio.to_thread.run_sync(run)
    finally:
        await client.aclose()
    assert len(statuses) >= 1000
    assert (await stack.client.get(f"/sessions/{PROTECTED}/trajectory")).content == before
