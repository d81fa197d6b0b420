"""Export document parts, the RL sample view and routed experts (R3)."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import pytest

from rollout_session.emulator import EmulatorConfig
from tests.conftest import TOOLS, Stack, StackFactory
from tests.integration.session.test_turns import check_document, echo, run_tool_episode
from tests.loopback import TLS

# The document's fields about the session (every schema has them).
SESSION_FIELDS = (
    "session_id",
    "status",
    "metadata",
    "created_at",
    "closed_at",
    "model",
    "sampling",
)


@pytest.mark.parametrize(
    ("include", "present"),
    [
        (None, {"turns", "messages"}),
        ("", set()),
        ("turns", {"turns"}),
        ("messages, turns", {"turns", "messages"}),
    ],
    ids=["default", "core-only", "turns", "both"],
)
async def test_include_selects_optional_parts(
    stack: Stack, include: str | None, present: set[str]
) -> None:
    session_id = await stack.create()
    await run_tool_episode(stack, session_id, turns=2)
    url = f"/sessions/{session_id}/trajectory"
    params = {} if include is None else {"include": include}
    doc = (await stack.client.get(url, params=params)).json()
    # Schema 3: each segment once, nothing of it repeated at the top level.
    assert doc["schema_version"] == 3
    assert set(doc) == {*SESSION_FIELDS, "schema_version", "num_segments", "rollbacks", "segments"}
    (segment,) = doc["segments"]
    assert {"turns", "messages", "routed_experts"} & set(segment) == present
    assert len(segment["token_ids"]) == len(segment["logprobs"])
    # ?schema=1: v1's document, the last (here the only) segment's fields at
    # the top level, with the same parts.
    v1 = (await stack.client.get(url, params={**params, "schema": "1"})).json()
    assert v1 == {
        "schema_version": 1,
        **{k: doc[k] for k in SESSION_FIELDS},
        **{k: v for k, v in segment.items() if k not in ("index", "branch")},
        "num_segments": 1,
    }


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"include": "turns,secrets"}, "include"),
        ({"format": "csv"}, "format"),
        ({"schema": "2"}, "schema"),
        ({"schema": "v1"}, "schema"),
        ({"format": "sample", "schema": "1"}, "schema"),
    ],
    ids=["include", "format", "schema-2", "schema-name", "schema-of-a-view"],
)
async def test_unknown_export_parameters_are_400_and_collect_nothing(
    stack: Stack, params: dict[str, str], param: str
) -> None:
    session_id = await stack.create()
    for method, path in (("GET", "/trajectory"), ("DELETE", "")):
        response = await stack.client.request(
            method, f"/sessions/{session_id}{path}", params=params
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_request", param)
    assert (await stack.client.get(f"/sessions/{session_id}")).json()["state"] == "open"


def expected_sample(doc: dict[str, Any], status: str) -> dict[str, Any]:
    """Built by hand from the full document: the sample is the response part."""
    start = doc["turns"][0]["completion_start"]
    mask = [0] * len(doc["token_ids"])
    logprobs = [0.0] * len(doc["token_ids"])
    versions: list[str | None] = [None] * len(doc["token_ids"])
    for turn in doc["turns"]:
        for i in range(turn["completion_start"], turn["completion_end"]):
            mask[i] = 1
            logprobs[i] = doc["logprobs"][i]
        for span in turn["weight_versions"]:
            for i in range(span["start"], span["end"]):
                versions[i] = span["version"]
    return {
        "episode_id": doc["session_id"],
        "segment": 0,
        "branch": None,
        "tokens": doc["token_ids"],
        "response_length": len(doc["token_ids"]) - start,
        "loss_mask": mask[start:],
        "rollout_log_probs": logprobs[start:],
        "rollout_weight_versions": versions[start:],
        # Each rescore's logprobs over the response (test_rescore.py): none here.
        "rescore_log_probs": {},
        "status": status,
        "rollout_sampling": [turn["sampling"] for turn in doc["turns"]],
        "metadata": doc["metadata"],
    }


async def sample_of(stack: Stack, session_id: str) -> dict[str, Any]:
    """The session's only sample."""
    url = f"/sessions/{session_id}/trajectory"
    view = (await stack.client.get(url, params={"format": "sample"})).json()
    assert (view["schema_version"], view["session_id"]) == (2, session_id)
    (sample,) = view["samples"]
    assert isinstance(sample, dict)
    return sample


async def test_sample_view_of_a_three_turn_tool_episode(stack: Stack) -> None:
    session_id = await stack.create(metadata={"prompt_id": 7})
    await run_tool_episode(stack, session_id, turns=3)
    doc = await stack.trajectory(session_id)
    sample = await sample_of(stack, session_id)
    assert sample == expected_sample(doc, "completed")
    # The tool results inside the response are observations: mask 0.
    assert 0 in sample["loss_mask"] and 1 in sample["loss_mask"]
    assert sample["loss_mask"][0] == 1  # the response starts with the first sampled token


async def test_sample_view_truncated(stack: Stack) -> None:
    session_id = await stack.create()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    first = (await stack.chat(session_id, messages=messages)).json()
    messages += [echo(first["choices"][0]["message"]), {"role": "user", "content": "more"}]
    await stack.chat(session_id, messages=messages, max_tokens=2)
    doc = await stack.trajectory(session_id)
    assert doc["turns"][-1]["finish_reason"] == "length"
    assert await sample_of(stack, session_id) == expected_sample(doc, "truncated")


async def test_sample_view_aborted(make_stack: StackFactory) -> None:
    """--on-abort return: the aborted answer is committed as it came."""
    stack = await make_stack(emulator=EmulatorConfig(fault="abort"), on_abort="return")
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=[{"role": "user", "content": "go"}])
    assert response.status_code == 200
    doc = await stack.trajectory(session_id)
    check_document(doc)
    assert doc["turns"][0]["finish_reason"] == "abort"
    assert await sample_of(stack, session_id) == expected_sample(doc, "aborted")


async def test_sample_view_of_an_empty_session_is_pending(stack: Stack) -> None:
    sample = await sample_of(stack, await stack.create())
    assert (sample["status"], sample["response_length"], sample["tokens"]) == ("pending", 0, [])


async def test_routed_experts_are_requested_incrementally_and_stored_once(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(routed_experts=True)
    session_id = await stack.create()
    await run_tool_episode(stack, session_id, turns=5)
    doc = await stack.trajectory(session_id)
    check_document(doc)
    sent = [r.body for r in stack.emulator.requests]
    starts = [body["routed_experts_start_len"] for body in sent]
    # Each turn asks only for positions past the previous turn's.
    assert starts == [0] + [t["completion_end"] - 1 for t in doc["turns"][:-1]]
    assert all(body["return_routed_experts"] for body in sent)
    # Each answer carried only the new positions: no growth with history.
    config = stack.emulator.config
    width = config.routed_experts_layers * config.routed_experts_top_k
    experts = doc["routed_experts"]
    positions = len(doc["token_ids"]) - 1
    assert experts["shape"] == [positions, width] and experts["dtype"] == "int32"
    stored = np.frombuffer(base64.b64decode(experts["data"]), "<i4")
    # The emulator's own full-sequence blob for the same tokens.
    async with httpx.AsyncClient(base_url=stack.emulator_url, verify=TLS) as client:
        full = (
            await client.post(
                "/v1/chat/completions",
                json={
                    "input_ids": doc["token_ids"],
                    "max_tokens": 1,
                    "tools": TOOLS,
                    "return_routed_experts": True,
                    "return_meta_info": True,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
        ).json()
    reference = np.frombuffer(
        base64.b64decode(full["choices"][0]["meta_info"]["routed_experts"]), "<i4"
    )
    assert np.array_equal(stored, reference[: positions * width])


async def test_routed_experts_follow_a_rollback(make_stack: StackFactory) -> None:
    stack = await make_stack(routed_experts=True)
    session_id = await stack.create()
    messages, _ = await run_tool_episode(stack, session_id, turns=2)
    retried = await stack.chat(session_id, messages=messages[:-1], tools=TOOLS, seed=42)
    assert retried.status_code == 200
    doc = await stack.trajectory(session_id)
    assert doc["routed_experts"]["shape"][0] == len(doc["token_ids"]) - 1
    assert stack.emulator.requests[-1].body["routed_experts_start_len"] == (
        doc["turns"][0]["completion_end"] - 1
    )


async def test_pieces_decode_each_token_with_special_tokens_visible(stack: Stack) -> None:
    session_id = await stack.create()
    await run_tool_episode(stack, session_id, turns=2)
    url = f"/sessions/{session_id}/trajectory"
    doc = (await stack.client.get(url, params={"include": "pieces,turns"})).json()
    (segment,) = doc["segments"]
    assert len(segment["pieces"]) == len(segment["token_ids"])
    assert segment["pieces"][0] == "<|im_start|>" and "<tool_call>" in segment["pieces"]
    assert "pieces" not in (await stack.client.get(url)).json()["segments"][0]  # not by default
    # The collection takes the same parameters as a read.
    closed = await stack.client.delete(
        f"/sessions/{session_id}", params={"include": "pieces", "schema": "1"}
    )
    assert closed.json()["pieces"] == segment["pieces"]
