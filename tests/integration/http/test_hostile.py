"""Property tests: hostile or malformed requests across all routes never get a
5xx and never change a committed trajectory; nearly-right Responses and
Messages bodies (tool calls and results that may or may not pair up) never
get a 5xx, commit only with a 200, and leave their connection usable.

The default profile sends 1,200 requests (240 examples × 5) and 40 nearly-right
bodies; a longer run: ``scripts/fuzz`` (``--hypothesis-profile=long``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import Stack
from tests.integration.raw_http import RawConnection
from tests.loopback import TLS

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
    client = httpx.AsyncClient(base_url=stack.url, timeout=30, verify=TLS)

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


# Nearly-right Responses and Messages bodies: well-formed enough that many
# are turns, with the parts agents get wrong drawn from small pools — call
# ids that may or may not pair up, tools whose schema may be no object,
# tool_choice without tools, out-of-range top_logprobs.
call_id = st.sampled_from(["c1", "c2", ""])
short_text = st.text(max_size=12)
schema: st.SearchStrategy[Any] = (
    st.sampled_from([{"type": "object"}, None, "x", [], {}]) | json_value
)
responses_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]), "content": short_text}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": call_id,
            "name": st.just("read_file"),
            "arguments": st.sampled_from(["{}", '{"path": "a"}', "x"]),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": call_id, "output": short_text}
    ),
)
nearly_responses = st.fixed_dictionaries(
    {"input": st.lists(responses_item, min_size=1, max_size=5), "max_output_tokens": st.just(4)},
    optional={
        "tools": st.lists(
            st.fixed_dictionaries(
                {"type": st.just("function"), "name": st.just("read_file"), "parameters": schema}
            ),
            max_size=1,
        ),
        "tool_choice": st.sampled_from(["auto", "required", {"type": "function", "name": "f"}]),
        "top_logprobs": st.integers(-1, 30) | json_value,
        "include": st.lists(short_text, max_size=1) | json_value,
    },
)
anthropic_nearly_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": short_text}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": call_id,
            "name": st.just("read_file"),
            "input": st.just({}),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": call_id, "content": short_text}
    ),
)
nearly_messages = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "max_tokens": st.just(4),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system"]),
                    "content": short_text | st.lists(anthropic_nearly_block, max_size=3),
                }
            ),
            min_size=1,
            max_size=5,
        ),
    },
    optional={
        "tools": st.lists(
            st.fixed_dictionaries({"name": st.just("read_file"), "input_schema": schema}),
            max_size=1,
        ),
        "tool_choice": st.sampled_from([{"type": "any"}, {"type": "tool", "name": "f"}]),
    },
)
nearly_right = st.one_of(
    nearly_responses.map(lambda b: ("/v1/responses", b)),
    nearly_messages.map(lambda b: ("/v1/messages", b)),
)


async def test_nearly_right_responses_and_messages_commit_only_with_a_200(
    stack: Stack,
) -> None:
    session_id = await stack.create()
    session = stack.ctx.registry.get(session_id)

    def committed() -> tuple[int, int, int]:
        return (len(session.earlier), len(session.trajectory.turns), len(session.trajectory))

    connection = await RawConnection.open(stack.url)
    statuses: list[int] = []

    # A sixth of the profile's examples (40 in CI): each may be a turn.
    @settings(max_examples=max(settings().max_examples // 6, 10))
    @given(nearly_right)
    def run(request: tuple[str, dict[str, Any]]) -> None:
        path, body = request
        before = trio.from_thread.run_sync(committed)
        answer = trio.from_thread.run(
            connection.request,
            "POST",
            f"/sessions/{session_id}{path}",
            {"content-type": "application/json"},
            dumps(body),
        )
        statuses.append(answer.status)
        assert answer.status < 500 and not answer.closes, (request, answer)
        if answer.status != 200:
            assert trio.from_thread.run_sync(committed) == before, request
            error = orjson.loads(answer.body)["error"]
            assert error["message"] and error["code"] == "invalid_request", (request, error)

    try:
        await trio.to_thread.run_sync(run)
    finally:
        await connection.aclose()
    # Both outcomes were drawn: the property is not vacuous.
    assert 200 in statuses and 400 in statuses, statuses
