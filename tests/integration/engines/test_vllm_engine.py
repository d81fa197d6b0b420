"""The ``vllm`` engine end to end: a session server in front of vLLM
emulator workers (``/inference/v1/generate``, derender), over real HTTP.

The same episode run on ``sglang-chat`` against an SGLang emulator with the
same seed is the reference: the emulator samples from the prompt ids alone
on every route, so trajectories (ids, logprobs, masks, routed experts) and
the agent's answers must be identical.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from rollout_session.emulator import EmulatorConfig
from rollout_session.emulator.faults import FaultPicker
from tests.conftest import TOOLS, Stack, StackFactory
from tests.integration.engines.test_answer_validator import comparable
from tests.integration.session.test_turns import check_document, run_tool_episode

# A vLLM worker as docs/deploy.md launches one for the bundled ChatML template.
VLLM = EmulatorConfig(
    engine="vllm",
    enable_scale_out=True,
    tool_call_parser="hermes",
    enable_prompt_tokens_details=True,
)
VLLM_SERVER: dict[str, Any] = {"engine": "vllm", "tool_call_parser": "hermes"}
USER = [{"role": "user", "content": "hello"}]


async def _episode(stack: Stack, turns: int = 4) -> tuple[dict[str, Any], list[Any]]:
    session_id = await stack.create()
    _, answers = await run_tool_episode(stack, session_id, turns=turns)
    doc = await stack.trajectory(session_id, schema=3)
    (segment,) = doc["segments"]
    check_document(segment)
    return doc, answers


def _without_call_ids(value: Any) -> Any:
    """`value` with every tool-call id (random on both engines, and in each
    engine's own format) and every tool message's echo of one blanked."""
    if isinstance(value, list):
        return [_without_call_ids(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _without_call_ids(v) for k, v in value.items()}
    if "tool_call_id" in out:
        out["tool_call_id"] = None
    if out.get("type") == "function" and "function" in out:
        out["id"] = None
    return out


def _without_sampling(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` without each turn's sampling record, which differs by engine."""
    segments = [
        {**s, "turns": [{k: v for k, v in t.items() if k != "sampling"} for t in s["turns"]]}
        for s in doc["segments"]
    ]
    return {**doc, "segments": segments}


def _agent_view(answers: list[Any]) -> list[Any]:
    out = []
    for answer in answers:
        choice = answer["choices"][0]
        message = choice["message"]
        out.append(
            (
                message["content"],
                message.get("reasoning_content"),
                [
                    (c["function"]["name"], c["function"]["arguments"])
                    for c in message.get("tool_calls") or []
                ],
                choice["finish_reason"],
            )
        )
    return out


@pytest.mark.parametrize("experts", [False, True], ids=["plain", "routed-experts"])
async def test_a_tool_episode_on_vllm_equals_sglang_chat(
    make_stack: StackFactory, experts: bool
) -> None:
    sglang = await make_stack(routed_experts=experts)
    vllm = await make_stack(
        emulator=replace(VLLM, return_routed_experts=experts), routed_experts=experts, **VLLM_SERVER
    )
    reference, reference_answers = await _episode(sglang)
    doc, answers = await _episode(vllm)
    assert any(a["choices"][0]["message"].get("tool_calls") for a in answers)
    assert _without_sampling(_without_call_ids(comparable(doc))) == _without_sampling(
        _without_call_ids(comparable(reference))
    )
    # vLLM is sent every sampling value (its /generate applies no model
    # default), so its turns record them; SGLang's chat route is left the
    # ones the request did not set, which its turns record as null.
    for engine_doc, temperature in ((doc, 1.0), (reference, None)):
        for turn in engine_doc["segments"][0]["turns"]:
            assert turn["sampling"]["temperature"] == temperature, turn["sampling"]
    (segment,) = doc["segments"]
    if experts:
        assert segment["routed_experts"]["shape"][0] > 0
    assert _agent_view(answers) == _agent_view(reference_answers)
    for answer in answers:
        for call in answer["choices"][0]["message"].get("tool_calls") or []:
            assert call["id"].startswith("chatcmpl-tool-"), call  # vLLM's own ids
    # vLLM names the weights "default" until the trainer sets a version.
    assert {t["weight_version"] for t in segment["turns"]} == {"default"}


async def test_turns_carry_the_session_for_a_router_and_the_chat_routes_parameters(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(emulator=VLLM, **VLLM_SERVER)
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER, tools=TOOLS, max_tokens=7, seed=3)
    assert response.status_code == 200, response.text
    record = stack.emulator.requests[-1]
    assert record.headers["x-session-id"] == session_id
    body = record.body
    assert body["output_mode"] == "derender"
    sampling = body["sampling_params"]
    assert (sampling["max_tokens"], sampling["seed"], sampling["logprobs"]) == (7, 3, 0)
    # Hermes2ProToolParser.adjust_request: special tokens kept for tool requests.
    assert sampling["skip_special_tokens"] is False
    assert body["parse_context"]["tool_choice"] == "auto"
    doc = await stack.trajectory(session_id)
    assert doc["turns"][0]["worker"] == stack.emulator_url


NAMED = {"type": "function", "function": {"name": "read_file"}}


@pytest.mark.parametrize(
    ("choice", "finish"),
    [("required", "tool_calls"), (NAMED, "stop")],
    ids=["required", "named"],
)
async def test_a_constraint_only_vllm_builds_is_taken_from_its_render_route(
    make_stack: StackFactory, choice: Any, finish: str
) -> None:
    stack = await make_stack(emulator=VLLM, **VLLM_SERVER)
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER, tools=TOOLS, tool_choice=choice)
    assert response.status_code == 200, response.text
    render, generate = stack.emulator.requests[-2:]
    assert (render.route, generate.route) == ("vllm-render", "vllm-generate")
    assert render.body["tool_choice"] == choice and render.body["max_tokens"] == 1
    # The worker's own constraint, sent unchanged.
    tag = generate.body["sampling_params"]["structured_outputs"]
    assert tag is not None and "structural_tag" in tag
    answer = response.json()["choices"][0]
    assert [c["function"]["name"] for c in answer["message"]["tool_calls"]] == ["read_file"]
    assert answer["finish_reason"] == finish


async def test_a_request_the_chat_route_refuses_is_refused_before_sending(
    make_stack: StackFactory,
) -> None:
    # No tool parser on the worker, nor here.
    stack = await make_stack(emulator=replace(VLLM, tool_call_parser=None), engine="vllm")
    session_id = await stack.create()
    sent = stack.emulator.received
    response = await stack.chat(session_id, messages=USER, tools=TOOLS)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in error["message"]
    assert stack.emulator.received == sent
    # Nothing committed; the connection serves the next turn.
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    assert len((await stack.trajectory(session_id))["turns"]) == 1


# Every fault the SGLang validator rejects, in vLLM's shapes: a 502 and nothing committed.
MALFORMED = [
    "malformed_json",
    "nan_logprob",
    "infinity_logprob",
    "positive_logprob",
    "bool_token_id",
    "str_token_id",
    "float_token_id",
    "out_of_vocab_id",
    "length_mismatch",
    "missing_meta_info",
    "prompt_tokens_mismatch",
]


@pytest.mark.parametrize("fault", MALFORMED)
async def test_a_bad_vllm_answer_is_a_502_and_nothing_is_committed(
    make_stack: StackFactory, fault: str
) -> None:
    stack = await make_stack(emulator=VLLM, circuit_failures=100, **VLLM_SERVER)
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    before = await stack.trajectory(session_id)
    stack.emulator.faults = FaultPicker(fault, 1.0, 0)
    messages = [*before["messages"], {"role": "user", "content": "next"}]
    response = await stack.chat(session_id, messages=messages)
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "upstream_malformed"
    assert await stack.trajectory(session_id) == before
    stack.emulator.faults = FaultPicker(None, 1.0, 0)
    assert (await stack.chat(session_id, messages=messages)).status_code == 200


@pytest.mark.parametrize("status", [400, 500])
async def test_vllms_own_errors_reach_the_agent_in_its_shape(
    make_stack: StackFactory, status: int
) -> None:
    stack = await make_stack(emulator=VLLM, circuit_failures=100, **VLLM_SERVER)
    session_id = await stack.create()
    stack.emulator.faults = FaultPicker(f"http_{status}", 1.0, 0)
    response = await stack.chat(session_id, messages=USER)
    assert response.status_code == status
    assert response.json()["error"]["code"] == status
    assert (await stack.trajectory(session_id))["turns"] == []


@pytest.mark.parametrize(
    ("emulator", "reason"),
    [
        (replace(VLLM, enable_scale_out=False), "--enable-scale-out"),
        (EmulatorConfig(), "not a vLLM worker"),
    ],
    ids=["scale-out-off", "sglang-worker"],
)
async def test_a_worker_vllm_cannot_use_is_never_admitted(
    make_stack: StackFactory, emulator: EmulatorConfig, reason: str
) -> None:
    stack = await make_stack(emulator=emulator, **VLLM_SERVER)
    pool = stack.ctx.pool
    worker = next(iter(pool.workers.values()))
    await pool.wait_until(lambda: worker.last_error is not None)
    assert reason in (worker.last_error or "")
    assert not worker.healthy
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER)
    assert response.status_code == 503
