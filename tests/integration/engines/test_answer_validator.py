"""The answer validator's CPU placement: large worker answers are validated in
worker processes, with exactly the result (or the error) of inline parsing."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.emulator.worker import EmulatorConfig
from tests.conftest import Stack, StackFactory
from tests.integration.engines.test_failures import USER, assert_released_and_clean
from tests.integration.session.test_turns import check_document, run_tool_episode

# process_threshold_kb=0: every answer goes to a validation process.
IN_PROCESS: dict[str, Any] = {"process_threshold_kb": 0, "parse_processes": 1}
INLINE: dict[str, Any] = {"parse_processes": 0}


def steady_turns(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in turn.items() if k != "worker" and not k.endswith(("_s", "_at"))}
        for turn in doc["turns"]
    ]


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """A trajectory without what differs between two runs (ids, clocks, ports)."""
    segments = [{**s, "turns": steady_turns(s)} for s in doc["segments"]]
    return {
        **doc,
        "session_id": None,
        "created_at": None,
        "segments": segments,
    }


async def test_answers_validated_in_a_process_equal_inline_ones(
    make_stack: StackFactory,
) -> None:
    docs = []
    for settings in (IN_PROCESS, INLINE):
        stack = await make_stack(routed_experts=True, **settings)
        session_id = await stack.create()
        await run_tool_episode(stack, session_id, turns=3)
        doc = await stack.trajectory(session_id, schema=3)
        for segment in doc["segments"]:
            check_document(segment)
        docs.append(comparable(doc))
        if settings is IN_PROCESS:
            assert stack.ctx.validator.processes is not None
            # The process really did the work: it is now idle, waiting for more.
            assert stack.ctx.validator.processes.statistics().idle_workers == 1
            # Every answer went there through a hand-off file, now removed.
            handoff = stack.ctx.validator.handoff
            assert handoff is not None and handoff.files_written == 3
            assert handoff.directory is not None
            assert list(handoff.directory.iterdir()) == []
        else:
            assert stack.ctx.validator.processes is None
    assert docs[0]["segments"][-1]["routed_experts"]["shape"][0] > 0
    assert docs[0] == docs[1]


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        ("nan_logprob", "json"),
        ("out_of_vocab_id", "token_id"),
        ("length_mismatch", "length_mismatch"),
        ("malformed_json", "json"),
    ],
    ids=lambda v: str(v),
)
async def test_malformed_answer_from_a_process_is_502_and_nothing_committed(
    make_stack: StackFactory, fault: str, kind: str
) -> None:
    stack: Stack = await make_stack(emulator=EmulatorConfig(fault=fault), **IN_PROCESS)
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=USER)
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "upstream_malformed"
    failures = stack.ctx.metrics.validation_failures.labels(kind)._value.get()
    assert failures == 1
    await assert_released_and_clean(stack, session_id)
