"""Contract: what the emulator answers is what SGLang's own models describe.

SGLang's pydantic protocol models (`sglang.srt.entrypoints.openai.protocol`)
are the reference for the upstream contract
(docs/api.md#what-the-worker-is-sent). Checked here, with
no field of ours left unknown to them: the emulator's text, tool-call and
reasoning answers (`ChatCompletionResponse`), the request the session server
forwards (`ChatCompletionRequest`) and the SSE chunks it streams
(`ChatCompletionStreamResponse`).

`sglang` is installed with ``pip install --no-deps sglang`` (its full
dependency set is the GPU stack). Its package ``__init__`` imports torch, so
`tests/sglang_source.py` loads the protocol module without running it. The
tests skip, with the reason, only when that import fails; with
``ROLLOUT_SESSION_REQUIRE_SGLANG=1`` (CI) they fail instead, so the check
cannot silently vanish.
"""

from __future__ import annotations

import types
from typing import Any

import orjson
import pytest
from pydantic import BaseModel

from rollout_session.emulator.worker import EmulatorConfig
from tests.conftest import TOOLS, StackFactory
from tests.integration.protocols.test_streaming import parse_sse
from tests.sglang_source import load_protocol, or_skip


@pytest.fixture(scope="module")
def sglang_protocol() -> types.ModuleType:
    return or_skip(load_protocol)


def unknown_fields(model: BaseModel, data: dict[str, Any], path: str = "$") -> list[str]:
    """Keys of ``data`` that ``model`` (validated from it) silently ignored."""
    found = []
    fields = type(model).model_fields
    for key, value in data.items():
        if key not in fields:
            found.append(f"{path}.{key}")
            continue
        attr = getattr(model, key)
        pairs = zip(attr, value, strict=True) if isinstance(attr, list) else [(attr, value)]
        for i, (sub_model, sub_data) in enumerate(pairs):
            if isinstance(sub_model, BaseModel) and isinstance(sub_data, dict):
                where = f"{path}.{key}[{i}]" if isinstance(attr, list) else f"{path}.{key}"
                found += unknown_fields(sub_model, sub_data, where)
    return found


# (id, chat template, emulator, request fields, what the answer must show)
ANSWERS: list[tuple[str, str, EmulatorConfig, dict[str, Any], str]] = [
    ("text", "chatml", EmulatorConfig(), {}, "content"),
    ("tool-call", "chatml", EmulatorConfig(), {"tools": TOOLS}, "tool_calls"),
    ("reasoning", "qwen3", EmulatorConfig(reasoning=True), {}, "reasoning_content"),
]
ANSWER_CASES = pytest.mark.parametrize(
    ("template", "emulator", "fields", "shows"),
    [a[1:] for a in ANSWERS],
    ids=[a[0] for a in ANSWERS],
)
USER = [{"role": "user", "content": "Read main.py and tell me what it does."}]


@ANSWER_CASES
async def test_emulator_answer_and_forwarded_request_match_sglang(
    sglang_protocol: types.ModuleType,
    make_stack: StackFactory,
    template: str,
    emulator: EmulatorConfig,
    fields: dict[str, Any],
    shows: str,
) -> None:
    stack = await make_stack(template=template, emulator=emulator)
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER, seed=5, **fields)
    assert response.status_code == 200, response.text
    data = response.json()  # the worker's bytes, passed through
    answer = sglang_protocol.ChatCompletionResponse.model_validate(data)
    assert unknown_fields(answer, data) == []
    assert getattr(answer.choices[0].message, shows)
    expected_finish = "tool_calls" if shows == "tool_calls" else "stop"
    assert answer.choices[0].finish_reason == expected_finish

    sent = stack.emulator.requests[-1].body
    request = sglang_protocol.ChatCompletionRequest.model_validate(sent)
    # Everything the server adds is a field SGLang knows (none is dropped).
    assert [k for k in sent if k not in type(request).model_fields] == []
    assert request.input_ids == sent["input_ids"] and request.return_meta_info


@ANSWER_CASES
async def test_streamed_chunks_match_sglang(
    sglang_protocol: types.ModuleType,
    make_stack: StackFactory,
    template: str,
    emulator: EmulatorConfig,
    fields: dict[str, Any],
    shows: str,
) -> None:
    stack = await make_stack(template=template, emulator=emulator)
    session_id = await stack.create()
    response = await stack.chat(
        session_id,
        messages=USER,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
        **fields,
    )
    assert response.status_code == 200, response.text
    chunks = parse_sse(response.content)
    shown = []
    for chunk in chunks:
        parsed = sglang_protocol.ChatCompletionStreamResponse.model_validate(chunk)
        assert unknown_fields(parsed, chunk) == [], orjson.dumps(chunk)
        shown += [k for c in chunk["choices"] for k, v in c["delta"].items() if v]
    assert shows in shown
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
