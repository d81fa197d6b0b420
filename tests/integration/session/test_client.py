"""The trainer-side client (asyncio and trio) and bulk export to JSONL/Parquet."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pandas as pd
import pytest
import trio
from datasets import load_dataset

from rollout_session.client import SessionClient, SessionServerError
from rollout_session.export import bulk as bulk_export
from tests.conftest import Stack, StackFactory
from tests.integration.session.test_turns import check_document
from tests.loopback import TLS


def one_agent_turn(base_url: str) -> None:
    client = openai.OpenAI(
        base_url=base_url,
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=TLS),
    )
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    client.close()


async def rollout(client: SessionClient, n: int) -> dict[str, dict[str, Any]]:
    """Ten lines of trainer code: create, let the agent run, collect."""
    docs: dict[str, dict[str, Any]] = {}
    for i in range(n):
        handle = await client.create(metadata={"episode": i})
        await trio.to_thread.run_sync(one_agent_turn, handle.base_url)
        # Either the handle `create` returned or its id names the session.
        session = handle if i % 2 else handle.session_id
        assert (await client.trajectory(session, view="sample"))["samples"][0][
            "response_length"
        ] > 0
        docs[handle.session_id] = await client.close(session)
    return docs


async def two_servers(make_stack: StackFactory) -> tuple[Stack, Stack]:
    return await make_stack(), await make_stack()


async def test_client_under_trio_shards_across_two_servers(make_stack: StackFactory) -> None:
    first, second = await two_servers(make_stack)
    async with SessionClient([first.url, second.url]) as client:
        docs = await rollout(client, 12)
        per_server = {first.url: 0, second.url: 0}
        for session_id, doc in docs.items():
            (segment,) = doc["segments"]
            check_document(segment)
            assert doc["status"] == "closed" and len(segment["turns"]) == 1
            per_server[client.server_for(session_id)] += 1
        # Each session lived (and was collected) on the server its id hashes to.
        assert first.emulator.received == per_server[first.url] > 0
        assert second.emulator.received == per_server[second.url] > 0
        # Collected, and readable again for --keep-collected-s.
        session_id, doc = next(iter(docs.items()))
        assert await client.trajectory(session_id) == doc
        # v1's document: the (one) segment's fields at the top level.
        v1 = await client.trajectory(session_id, schema=1)
        (segment,) = doc["segments"]
        assert v1["schema_version"] == 1 and "segments" not in v1
        assert v1["token_ids"] == segment["token_ids"] and v1["turns"] == segment["turns"]
        with pytest.raises(SessionServerError) as info:
            await client.trajectory("never-created")
        assert info.value.code == "session_not_found"


async def test_client_under_asyncio(make_stack: StackFactory) -> None:
    first, second = await two_servers(make_stack)

    async def with_asyncio() -> list[tuple[str, str]]:
        async with SessionClient([first.url, second.url]) as client:
            handles = [await client.create() for _ in range(8)]
            return [(h.session_id, h.server) for h in handles]

    made = await trio.to_thread.run_sync(asyncio.run, with_asyncio())
    assert {server for _, server in made} == {first.url, second.url}
    for session_id, server in made:
        stack = first if server == first.url else second
        assert stack.ctx.registry.get(session_id).id == session_id


async def test_create_retry_after_lost_answer_is_idempotent(stack: Stack) -> None:
    async with SessionClient([stack.url]) as client:
        handle = await client.create("episode-1")
        # The same create again (as a retry whose first answer was lost would).
        response, _ = await client._send(
            "POST", f"{stack.url}/sessions", json={"session_id": "episode-1"}
        )
        assert response.status_code == 409
        assert handle.base_url == f"{stack.url}/sessions/episode-1/v1"


async def populate(stack: Stack, n: int) -> None:
    """`n` sessions; every fourth has two segments (its agent edited its question)."""

    async def one(i: int) -> None:
        session_id = await stack.create(session_id=f"s{i:03d}", metadata={"i": i})
        response = await stack.chat(session_id, messages=[{"role": "user", "content": str(i)}])
        assert response.status_code == 200
        if i % 4 == 0:
            edited = [{"role": "user", "content": f"{i}, edited"}]
            assert (await stack.chat(session_id, messages=edited)).status_code == 200

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)


async def test_bulk_export_round_trips_50_sessions(stack: Stack, tmp_path: Path) -> None:
    await populate(stack, 50)
    originals = {s.id: await stack.trajectory(s.id, schema=3) for s in stack.ctx.registry}
    jsonl, n_jsonl = await trio.to_thread.run_sync(
        lambda: bulk_export.export_sessions(stack.url, tmp_path / "j", progress=False)
    )
    v1_jsonl, _ = await trio.to_thread.run_sync(
        lambda: bulk_export.export_sessions(stack.url, tmp_path / "v1", schema=1, progress=False)
    )
    parquet, n_parquet = await trio.to_thread.run_sync(
        lambda: bulk_export.export_sessions(
            stack.url, tmp_path / "p", fmt="parquet", progress=False
        )
    )
    assert n_jsonl == n_parquet == 50
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {doc["session_id"]: doc for doc in lines} == originals
    # --schema 1: v1's documents, the last segment's fields at the top level.
    for line in v1_jsonl.read_text().splitlines():
        v1 = json.loads(line)
        last = originals[v1["session_id"]]["segments"][-1]
        assert v1["schema_version"] == 1 and "segments" not in v1
        assert (v1["token_ids"], v1["turns"]) == (last["token_ids"], last["turns"])

    # Parquet: one row per segment.
    frame = pd.read_parquet(parquet)
    dataset = load_dataset("parquet", data_files=str(parquet), split="train")
    assert len(frame) == len(dataset) == 50 + len(range(0, 50, 4))  # s000, s004 … two each
    for row, record in zip(frame.itertuples(), dataset, strict=True):
        doc = originals[row.session_id]
        segment = doc["segments"][row.segment]
        assert (
            row.num_segments == doc["num_segments"] == (2 if doc["metadata"]["i"] % 4 == 0 else 1)
        )
        assert list(row.token_ids) == segment["token_ids"] == record["token_ids"]
        assert list(row.loss_mask) == segment["loss_mask"]
        logprobs = np.float32(segment["logprobs"])
        assert np.array_equal(np.asarray(row.logprobs, np.float32), logprobs)
        assert json.loads(row.turns) == segment["turns"]
        assert json.loads(row.messages) == segment["messages"]
        assert json.loads(row.metadata) == doc["metadata"]
        branch = json.loads(row.branch) if isinstance(row.branch, str) else None
        assert branch == segment["branch"]
        assert row.prompt_length == segment["prompt_length"] and row.status == "open"
        assert row.schema_version == 3


async def test_bulk_export_close_collects(stack: Stack, tmp_path: Path) -> None:
    await populate(stack, 5)
    path, written = await trio.to_thread.run_sync(
        lambda: bulk_export.export_sessions(stack.url, tmp_path, close=True, progress=False)
    )
    assert written == 5 and len(stack.ctx.registry) == 0
    assert {json.loads(line)["status"] for line in path.read_text().splitlines()} == {"closed"}
    # Nothing matches the "closed" (server-expired) state here.
    _, none = await trio.to_thread.run_sync(
        lambda: bulk_export.export_sessions(
            stack.url, tmp_path / "e", state="closed", progress=False
        )
    )
    assert none == 0
