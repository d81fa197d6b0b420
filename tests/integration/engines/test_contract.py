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
`load_sglang_protocol` imports the protocol module without running it. The
tests skip, with the reason, only when that import fails; with
``ROLLOUT_SESSION_REQUIRE_SGLANG=1`` (CI) they fail instead, so the check
cannot silently vanish.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import BaseModel

from rollout_session.testing.emulator import EmulatorConfig
from tests.conftest import TOOLS, StackFactory
from tests.integration.protocols.test_streaming import parse_sse

PROTOCOL = "sglang.srt.entrypoints.openai.protocol"
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.openai")


def load_sglang_protocol() -> types.ModuleType:
    """Import SGLang's protocol module without running ``sglang/__init__.py``.

    The parent packages are registered as empty modules whose ``__path__`` is
    the installed package's directory, so the import system finds the
    submodules but never executes the parents' ``__init__`` (torch, CUDA).
    """
    if PROTOCOL in sys.modules:
        return sys.modules[PROTOCOL]
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed (pip install --no-deps sglang)")
    root = Path(next(iter(spec.submodule_search_locations)))
    for name in _PACKAGES:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = package
    # sglang.utils imports IPython's notebook display helpers at the top; the
    # protocol models never use them. Stand in for IPython only while importing,
    # and only when it is not installed.
    stubs = {}
    if importlib.util.find_spec("IPython") is None:
        display = types.ModuleType("IPython.display")
        display.HTML = display.display = None  # type: ignore[attr-defined]
        stubs = {"IPython": types.ModuleType("IPython"), "IPython.display": display}
    sys.modules.update(stubs)
    try:
        with warnings.catch_warnings():
            # Third-party import-time deprecation noise is not ours to fix.
            warnings.simplefilter("ignore")
            return importlib.import_module(PROTOCOL)
    finally:
        for name in stubs:
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def sglang_protocol() -> types.ModuleType:
    try:
        return load_sglang_protocol()
    except Exception as exc:
        reason = f"cannot import SGLang's protocol models: {type(exc).__name__}: {exc}"
        if os.environ.get("ROLLOUT_SESSION_REQUIRE_SGLANG"):
            pytest.fail(reason)
        pytest.skip(reason)


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
