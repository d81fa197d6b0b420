"""POST /sessions/{id}/rescore: a session's exact tokens scored by another
policy (docs/training.md#rescoring), over real HTTP to emulator workers."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from rollout_session import create_app
from rollout_session.client import SessionClient, SessionServerError
from rollout_session.emulator import TextModel
from rollout_session.emulator.faults import FaultPicker
from rollout_session.export import bulk as bulk_export
from rollout_session.http.app import server_context
from rollout_session.http.serving import start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from rollout_session.turn.rescore import MAX_LABELS
from tests.conftest import Stack, StackFactory, spawn_worker
from tests.families import template_text
from tests.integration.engines.test_weight_updates import (
    ENGINES,
    Engine,
    make,
    update_weights,
)
from tests.loopback import TLS
from tests.stalls import until

USER = [{"role": "user", "content": "hello"}]

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "no-target": ({"label": "t"}, "target"),
    "empty-target": ({"target": "", "label": "t"}, "target"),
    "no-label": ({"target": "pinned"}, "label"),
    "label-with-space": ({"target": "pinned", "label": "a b"}, "label"),
    "label-too-long": ({"target": "pinned", "label": "x" * 65}, "label"),
    "positions": ({"target": "pinned", "label": "t", "positions": "prompt"}, "positions"),
    "unknown-field": ({"target": "pinned", "label": "t", "temperature": 1}, "temperature"),
    "teacher-without-teachers": ({"target": "teacher", "label": "t"}, "target"),
    "unknown-worker": ({"target": "http://127.0.0.1:9", "label": "t"}, "target"),
}


@pytest.mark.parametrize(("body", "param"), REFUSED.values(), ids=REFUSED.keys())
async def test_a_bad_rescore_request_is_a_400_naming_its_field(
    stack: Stack, body: dict[str, Any], param: str
) -> None:
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    answer = await stack.client.post(f"/sessions/{session_id}/rescore", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert stack.emulator.received == 1  # the turn's only


async def test_pinned_needs_a_turn_first(stack: Stack) -> None:
    session_id = await stack.create()
    answer = await stack.client.post(
        f"/sessions/{session_id}/rescore", json={"target": "pinned", "label": "t"}
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "target"


async def test_a_session_keeps_at_most_max_labels_labels(stack: Stack) -> None:
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    url = f"/sessions/{session_id}/rescore"
    for i in range(MAX_LABELS):
        answer = await stack.client.post(url, json={"target": "pinned", "label": f"l{i}"})
        assert answer.status_code == 200, answer.text
    refused = await stack.client.post(url, json={"target": "pinned", "label": "one-more"})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "label"
    assert f"({MAX_LABELS})" in refused.json()["error"]["message"]
    # A label held is replaced as before.
    again = await stack.client.post(url, json={"target": "pinned", "label": "l0"})
    assert again.status_code == 200
    rescores = (await stack.trajectory(session_id, schema=3))["segments"][0]["rescores"]
    assert sorted(rescores) == sorted(f"l{i}" for i in range(MAX_LABELS))


async def test_an_unknown_session_is_a_404(stack: Stack) -> None:
    answer = await stack.client.post(
        "/sessions/nope/rescore", json={"target": "pinned", "label": "t"}
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "session_not_found"


# -- end to end: emulator workers whose logprobs are one model of the context --


async def teacher(nursery: trio.Nursery, text_model: TextModel, engine: Engine) -> str:
    """A worker of the same engine with another seed: another policy."""
    config = replace(
        engine.emulator, seed=1000, chat_template=template_text("qwen3"), weight_version="t1"
    )
    worker = await spawn_worker(nursery, text_model, config)
    return worker.server.url


async def episode(stack: Stack, turns: int = 2) -> str:
    session_id = await stack.create()
    messages: list[dict[str, Any]] = list(USER)
    for i in range(turns):
        answer = await stack.chat(session_id, messages=messages, max_tokens=24)
        assert answer.status_code == 200, answer.text
        messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": f"{i}"}]
    return session_id


@contextlib.asynccontextmanager
async def rescore_at_worker(stack: Stack, session_id: str) -> AsyncIterator[list[httpx.Response]]:
    """A pinned rescore of the session held at its worker (the GPU stalled
    once the scoring request is in) while the block runs; its answer is in
    the list after the block."""
    emulator = stack.emulator
    answers: list[httpx.Response] = []

    async def trainer() -> None:
        answers.append(await rescore(stack, session_id, target="pinned", label="p"))

    emulator.gpu.freeze()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trainer)
        await until(lambda: bool(emulator.weights.runs()))  # the scoring request is in
        try:
            yield answers
        finally:
            emulator.gpu.thaw()


async def rescore(stack: Stack, session_id: str, **body: Any) -> httpx.Response:
    return await stack.client.post(f"/sessions/{session_id}/rescore", json=body)


@pytest.mark.parametrize("name", ENGINES, ids=list(ENGINES))
async def test_the_pinned_worker_scores_its_own_samples_as_it_sampled_them(
    make_stack: StackFactory, name: str
) -> None:
    """The same weights score the sampled tokens exactly as they were
    sampled (the emulator, like an engine at temperature 1): drift 0; the
    positions not sampled are null; the export carries what the answer said."""
    stack = await make(make_stack, ENGINES[name], decode_s=0.0, completion_tokens=24)
    session_id = await episode(stack)
    received = stack.emulator.received
    answer = await rescore(stack, session_id, target="pinned", label="current")
    assert answer.status_code == 200, answer.text
    assert stack.emulator.received == received + 1  # one request: one segment
    (scored,) = answer.json()["segments"]
    doc = await stack.trajectory(session_id, schema=3)
    (segment,) = doc["segments"]
    stored = segment["rescores"]["current"]
    assert {k: v for k, v in scored.items() if k != "index"} == stored
    mask = np.array(segment["loss_mask"], bool)
    values = np.array(stored["logprobs"], float)  # None -> nan
    assert np.isnan(values[~mask]).all()
    assert values[mask].tolist() == np.array(segment["logprobs"], float)[mask].tolist()
    assert stored["scored_tokens"] == len(segment["token_ids"])
    assert (stored["worker"], stored["weight_version"]) == (stack.emulator_url, "v1")
    assert stored["model"] == doc["model"] or stored["model"] == stack.ctx.model.name
    drift = stored["drift"]
    assert (drift["tokens"], drift["max_abs"], drift["approx_kl"]) == (int(mask.sum()), 0.0, 0.0)
    assert [t["tokens"] for t in drift["turns"]] == [24, 24]
    sample = (
        await stack.client.get(f"/sessions/{session_id}/trajectory", params={"format": "sample"})
    ).json()["samples"][0]
    response_mask = np.array(sample["loss_mask"], bool)
    rescored = np.array(sample["rescore_log_probs"]["current"], float)
    rollout = np.array(sample["rollout_log_probs"], float)
    assert np.array_equal(rescored[response_mask], rollout[response_mask])


@pytest.mark.parametrize("name", ENGINES, ids=list(ENGINES))
async def test_a_teacher_scores_every_position_of_the_same_tokens_differently(
    make_stack: StackFactory, nursery: trio.Nursery, text_model: TextModel, name: str
) -> None:
    url = await teacher(nursery, text_model, ENGINES[name])
    stack = await make(
        make_stack, ENGINES[name], decode_s=0.0, completion_tokens=24, teacher_workers=(url,)
    )
    session_id = await episode(stack)
    turns = stack.emulator.received
    answer = await rescore(stack, session_id, target="teacher", label="t", positions="all")
    assert answer.status_code == 200, answer.text
    assert stack.emulator.received == turns  # the policy worker is not asked
    (scored,) = answer.json()["segments"]
    values = scored["logprobs"]
    assert values[0] is None and None not in values[1:]
    assert all(v <= 0 for v in values[1:])
    assert (scored["worker"], scored["weight_version"], scored["target"]) == (url, "t1", "teacher")
    assert scored["drift"]["mean_abs"] > 0 and scored["drift"]["approx_kl"] > 0
    listed = (await stack.client.get("/workers")).json()
    assert [w["url"] for w in listed["teachers"]] == [url]
    assert [w["url"] for w in listed["workers"]] == [stack.emulator_url]


async def test_after_a_weight_update_the_pinned_worker_scores_with_the_new_policy(
    make_stack: StackFactory,
) -> None:
    stack = await make(make_stack, ENGINES["sglang-generate"], decode_s=0.0, completion_tokens=24)
    session_id = await episode(stack, turns=1)
    before = (await rescore(stack, session_id, target="pinned", label="p")).json()
    update_weights(stack.emulator, "v2", abort=False)
    after = (await rescore(stack, session_id, target="pinned", label="p")).json()
    (old,), (new,) = before["segments"], after["segments"]
    assert (old["weight_version"], new["weight_version"]) == ("v1", "v2")
    assert old["drift"]["max_abs"] == 0.0 < new["drift"]["max_abs"]
    # One rescore per label: the second replaced the first.
    doc = await stack.trajectory(session_id, schema=3)
    assert doc["segments"][0]["rescores"]["p"]["weight_version"] == "v2"


@pytest.mark.parametrize("resends", [1, 0], ids=["sent-again", "past-max-continuations"])
@pytest.mark.parametrize("name", ENGINES, ids=list(ENGINES))
async def test_a_weight_update_that_aborts_the_scoring_request(
    make_stack: StackFactory, name: str, resends: int
) -> None:
    """The trainer updates the worker's weights, aborting what runs, while
    the scoring request waits in it (the GPU stalled: not yet prefilled).
    The engine's abort is not the worker's failure: the request is sent
    again (within --max-continuations) and scored by the new policy, or the
    rescore is a 503 that stores nothing."""
    stack = await make(
        make_stack,
        ENGINES[name],
        decode_s=0.0,
        completion_tokens=24,
        max_continuations=resends,
    )
    session_id = await episode(stack, turns=1)
    async with rescore_at_worker(stack, session_id) as answers:
        update_weights(stack.emulator, "v2", abort=True)
    (answer,) = answers
    (worker,) = stack.ctx.pool.workers.values()
    assert worker.circuit_failures == 0 and worker.last_error is None
    stored = (await stack.trajectory(session_id, schema=3))["segments"][0]["rescores"]
    if resends:
        assert answer.status_code == 200, answer.text
        assert stored["p"]["weight_version"] == "v2"
        assert stored["p"]["drift"]["max_abs"] > 0.0
    else:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "rescore_interrupted"
        assert "aborted the scoring request" in answer.json()["error"]["message"]
        assert answer.headers["retry-after"] == "1"
        assert stored == {}


def _scoring(body: Any) -> bool:
    """vLLM's scoring request (the SGLang emulator's /generate models no faults)."""
    params = body.get("sampling_params") if isinstance(body, dict) else None
    return isinstance(params, dict) and params.get("prompt_logprobs") is not None


@pytest.mark.parametrize("fault", ["malformed_json", "http_500"], ids=["malformed", "http-500"])
async def test_a_bad_scoring_answer_is_a_502_and_nothing_is_stored(
    make_stack: StackFactory, fault: str
) -> None:
    stack = await make(make_stack, ENGINES["vllm"], decode_s=0.0, completion_tokens=24)
    session_id = await episode(stack, turns=1)
    stack.emulator.faults = FaultPicker(fault, 1.0, 0, only=_scoring)
    answer = await rescore(stack, session_id, target="pinned", label="p")
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == (
        "upstream_malformed" if fault == "malformed_json" else "upstream_error"
    )
    assert stack.emulator.faults_injected[fault] == 1
    doc = await stack.trajectory(session_id, schema=3)
    assert doc["segments"][0]["rescores"] == {}
    # The session goes on: its worker still takes turns.
    stack.emulator.faults = FaultPicker(None, 0.0, 0)
    await episode(stack, turns=1)


@pytest.mark.parametrize("restart", [False, True], ids=["collected", "collected-restarted"])
async def test_pinned_rescores_a_collected_session_on_the_worker_that_sampled_it(
    make_stack: StackFactory,
    nursery: trio.Nursery,
    chat_tokenizers: dict[str, ChatTokenizer],
    tmp_path: Path,
    restart: bool,
) -> None:
    """A DELETE unpins the session; its rescore ``pinned`` still goes to the
    worker it was pinned to (also once a restart replayed the collection)."""
    stack = await make(
        make_stack,
        ENGINES["sglang-chat"],
        decode_s=0.0,
        completion_tokens=24,
        journal=str(tmp_path),
    )
    session_id = await episode(stack, turns=1)
    assert (await stack.client.delete(f"/sessions/{session_id}")).status_code == 200
    if restart:  # a new server on the same worker and journal
        await stack.server.aclose()
        settings = replace(stack.ctx.settings, port=0)
        app = create_app(settings, tokenizer=chat_tokenizers["qwen3"], worker_tls=TLS)
        server = await start_server(nursery, app)
        client = httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS)
        stack = Stack(server.url, server_context(app), stack.workers, client, server)
    answer = await rescore(stack, session_id, target="pinned", label="p")
    assert answer.status_code == 200, answer.text
    (scored,) = answer.json()["segments"]
    assert scored["worker"] == stack.emulator_url
    assert scored["drift"]["max_abs"] == 0.0  # the policy that sampled it
    summary = (await stack.client.get(f"/sessions/{session_id}")).json()
    assert (summary["state"], summary["worker"]) == ("closed", None)
    if restart:
        await stack.client.aclose()
        await stack.server.aclose()


async def test_a_rescore_its_session_was_collected_during_stores_nothing(
    make_stack: StackFactory,
) -> None:
    """A DELETE answered while a rescore was at the worker: the trainer's
    document has no such rescore, so the rescore is refused (404
    session_closing, nothing stored) and a repeated DELETE answers the same
    document. The collected session is then rescored as asked."""
    stack = await make(make_stack, ENGINES["sglang-chat"], decode_s=0.0, completion_tokens=24)
    session_id = await episode(stack, turns=1)
    async with rescore_at_worker(stack, session_id) as answers:
        first = await stack.client.delete(f"/sessions/{session_id}")
    assert first.status_code == 200
    (late,) = answers
    assert late.status_code == 404, late.text
    assert late.json()["error"]["code"] == "session_closing"
    again = await stack.client.delete(f"/sessions/{session_id}")
    assert again.json() == first.json()
    assert first.json()["segments"][0]["rescores"] == {}
    answer = await rescore(stack, session_id, target="pinned", label="p")
    assert answer.status_code == 200, answer.text
    doc = await stack.trajectory(session_id, schema=3)
    assert list(doc["segments"][0]["rescores"]) == ["p"]


async def test_every_segment_is_rescored(make_stack: StackFactory) -> None:
    stack = await make(make_stack, ENGINES["sglang-chat"], decode_s=0.0, completion_tokens=24)
    session_id = await stack.create()
    assert (await stack.chat(session_id, messages=USER)).status_code == 200
    # The agent drops the answer and asks something else: a second segment.
    dropped = [*USER, {"role": "user", "content": "x"}]
    assert (await stack.chat(session_id, messages=dropped)).status_code == 200
    answer = await rescore(stack, session_id, target="pinned", label="p")
    assert [s["index"] for s in answer.json()["segments"]] == [0, 1]
    doc = await stack.trajectory(session_id, schema=3)
    lengths = [len(s["token_ids"]) for s in doc["segments"]]
    assert [s["rescores"]["p"]["scored_tokens"] for s in doc["segments"]] == lengths
    assert all(s["rescores"]["p"]["drift"]["max_abs"] == 0.0 for s in doc["segments"])


async def test_a_retry_cuts_the_rescore_where_the_replaced_turn_began(
    make_stack: StackFactory,
) -> None:
    stack = await make(make_stack, ENGINES["sglang-chat"], decode_s=0.0, completion_tokens=24)
    session_id = await stack.create()
    first = await stack.chat(session_id, messages=USER)
    second = [*USER, first.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    assert (await stack.chat(session_id, messages=second)).status_code == 200
    assert (await rescore(stack, session_id, target="pinned", label="p")).status_code == 200
    # The agent never saw the second answer and sends the request again:
    # the second turn is replaced, and the rescore keeps only the first's.
    assert (await stack.chat(session_id, messages=second)).status_code == 200
    doc = await stack.trajectory(session_id, schema=3)
    assert doc["rollbacks"][-1]["reason"] == "retry"
    (segment,) = doc["segments"]
    cut = segment["turns"][1]["prompt_start"]
    stored = segment["rescores"]["p"]
    assert cut > 0 and stored["scored_tokens"] == cut
    assert stored["logprobs"][cut:] == [None] * (len(segment["token_ids"]) - cut)
    assert [t["tokens"] for t in stored["drift"]["turns"]] == [24, 0]


async def test_the_client_and_the_bulk_export_rescore_with_a_teacher(
    make_stack: StackFactory, nursery: trio.Nursery, text_model: TextModel, tmp_path: Path
) -> None:
    engine = ENGINES["sglang-chat"]
    url = await teacher(nursery, text_model, engine)
    stack = await make(
        make_stack, engine, decode_s=0.0, completion_tokens=24, teacher_workers=(url,)
    )
    ids = [await episode(stack, turns=1) for _ in range(5)]
    async with SessionClient([stack.url], timeout_s=30) as client:
        answer = await client.rescore(ids[0], "teacher", "distill")
        assert answer["segments"][0]["worker"] == url
        with pytest.raises(SessionServerError) as refused:
            await client.rescore(ids[0], "nobody", "distill")
        assert refused.value.status_code == 400
        many = await client.rescore_all(ids, "pinned", "current", concurrency=2)
        assert [a["session_id"] for a in many] == ids
        assert all(a["segments"][0]["drift"]["max_abs"] == 0.0 for a in many)
    rescore = bulk_export.Rescore.parse("teacher:distill", concurrency=3)
    path, written = await trio.to_thread.run_sync(
        lambda: bulk_export.export_sessions(
            stack.url, tmp_path, close=True, progress=False, rescore=rescore
        )
    )
    assert written == 5 and len(stack.ctx.registry) == 0
    for line in path.read_text().splitlines():
        (segment,) = json.loads(line)["segments"]
        distill = segment["rescores"]["distill"]
        assert distill["scored_tokens"] == len(segment["token_ids"])
        assert distill["worker"] == url and distill["drift"]["tokens"] == 24


async def test_a_bulk_rescore_that_fails_stops_the_export_with_the_servers_error(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    stack = await make(make_stack, ENGINES["sglang-chat"], decode_s=0.0, completion_tokens=24)
    for _ in range(3):
        await episode(stack, turns=1)
    rescore = bulk_export.Rescore.parse("teacher:distill")  # no --teacher-worker
    with pytest.raises(SystemExit, match="no teacher workers"):
        await trio.to_thread.run_sync(
            lambda: bulk_export.export_sessions(
                stack.url, tmp_path, close=True, progress=False, rescore=rescore
            )
        )
    assert len(stack.ctx.registry) == 3  # nothing collected


@pytest.mark.parametrize(
    ("raw", "target"),
    [("teacher:t", "teacher"), ("http://10.0.0.1:30000:t", "http://10.0.0.1:30000")],
    ids=["keyword", "url"],
)
def test_the_bulk_rescore_flag_splits_at_the_last_colon(raw: str, target: str) -> None:
    assert bulk_export.Rescore.parse(raw) == bulk_export.Rescore(target, "t")


@pytest.mark.parametrize(
    "raw", ["teacher", ":t", "teacher:"], ids=["bare", "no-target", "no-label"]
)
def test_a_bulk_rescore_flag_without_target_and_label_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="TARGET:LABEL"):
        bulk_export.Rescore.parse(raw)
