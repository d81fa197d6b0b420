"""`SessionAgentLoop` in the released verl 0.9.1: built by verl's agent-loop
worker from its YAML entry, run as verl runs it, its outputs post-processed
by verl (the legacy trainer's padded batch, the v1 trainer's records), and
what verl would train on checked equal to the session's export.

Runs in scripts/test-trainers' verl venv; skipped where verl is not installed.
"""

from __future__ import annotations

from tests.trainers.require import require

require("verl", "scripts/test-trainers builds the verl venv")

import contextlib  # noqa: E402
import warnings  # noqa: E402
from collections.abc import AsyncIterator, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
import trio  # noqa: E402

from rollout_session import Settings, create_app  # noqa: E402
from rollout_session.emulator import EmulatorConfig, TextModel, bundled_tokenizer_path  # noqa: E402
from rollout_session.http.serving import start_server  # noqa: E402
from rollout_session.prompt.tokenizer import ChatTokenizer  # noqa: E402
from rollout_session.trainers.segments import SegmentTokens, routed_experts  # noqa: E402
from tests.conftest import Worker, spawn_worker  # noqa: E402
from tests.loopback import TLS  # noqa: E402
from tests.stalls import in_flight_midway, stalled  # noqa: E402
from tests.trainers.verl import agents  # noqa: E402

# verl's and Ray's own imports warn (their deprecations, not ours).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import ray
    import torch
    from verl.checkpoint_engine.base import CheckpointEngineManager

    from rollout_session.trainers.verl import install_weight_sync
    from tests.trainers.verl.harness import (
        LegacyWorker,
        V1Worker,
        balancer,
        in_asyncio,
        model_dir,
        rows,
        verl_config,
    )

# What verl samples with (its rollout config's defaults: temperature 1.0,
# top_p 1.0, top_k -1), pinned on every session.
VERL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return model_dir(tmp_path)


@dataclass
class Servers:
    """Emulator workers launched as verl launches SGLang (without a
    tokenizer, without parsers), and a session server started without
    workers: the agent loops register verl's."""

    url: str
    client: httpx.AsyncClient
    workers: list[Worker]

    @property
    def addresses(self) -> list[str]:
        """The workers as verl's load balancer lists them (``host:port``)."""
        return [w.url.removeprefix("http://") for w in self.workers]

    async def document(self, session_id: str) -> dict[str, Any]:
        """The collected export, asked again (a repeated DELETE answers it)."""
        response = await self.client.delete(f"/sessions/{session_id}", params={"schema": 3})
        assert response.status_code == 200, response.text
        doc: dict[str, Any] = response.json()
        return doc


@contextlib.asynccontextmanager
async def start_servers(
    nursery: trio.Nursery,
    text_model: TextModel,
    tokenizer: ChatTokenizer,
    *,
    emulator: EmulatorConfig | None = None,
    rollout: str = "sglang",
    **settings: Any,
) -> AsyncIterator[Servers]:
    """The workers as verl launches them (`LAUNCHED`), behind a session
    server started without workers (the loops register them): the engine,
    the tokenizer and the parser named, the rest learned from the first."""
    config = emulator or EmulatorConfig()
    worker = await spawn_worker(
        nursery,
        text_model,
        EmulatorConfig(
            **{**config.__dict__, **LAUNCHED[rollout], "chat_template": tokenizer.chat_template}
        ),
        parsers=False,
    )
    engine, parser = SERVED[rollout]
    app_settings = Settings(
        workers=(),
        engine=engine,
        tokenizer=str(bundled_tokenizer_path()),
        tool_call_parser=parser,
        port=0,
        **settings,
    )
    app = create_app(app_settings, tokenizer=tokenizer, worker_tls=TLS)
    server = await start_server(nursery, app, max_connections=app_settings.max_connections)
    async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
        yield Servers(server.url, client, [worker])
    await server.aclose()


# How verl 0.9.1 launches each rollout's servers: SGLang without a tokenizer
# and without parsers (`workers/config/rollout.py`, `async_sglang_server.py`
# `launch_server`); vLLM with its sampling as generation-config overrides
# (`vllm_async_server.py` `_get_override_generation_config`), scale-out on
# (`engine_kwargs.vllm.enable_scale_out=true`) and the tool parser the user
# gives it.
LAUNCHED: dict[str, dict[str, Any]] = {
    "sglang": {"skip_tokenizer_init": True},
    "vllm": {
        "engine": "vllm",
        "enable_scale_out": True,
        "tool_call_parser": "hermes",
        "override_generation_config": {
            "temperature": 1.0,
            "top_k": -1,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
            "max_new_tokens": 2048,
        },
    },
}
# The session server's engine and tool-call parser (the engine's names) for each.
SERVED = {"sglang": ("sglang-generate", "qwen25"), "vllm": ("vllm", "hermes")}


@pytest.fixture(params=["sglang", "vllm"], ids=["sglang", "vllm"])
async def servers(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    request: pytest.FixtureRequest,
) -> AsyncIterator[Servers]:
    """verl's rollout servers of each kind behind a workerless session server."""
    async with start_servers(
        nursery, text_model, chat_tokenizers["chatml"], rollout=request.param
    ) as started:
        yield started


def entry(servers: Servers, agent: str, **keys: Any) -> dict[str, Any]:
    return {"servers": [servers.url], "agent": f"tests.trainers.verl.agents:{agent}", **keys}


def unpadded(row: torch.Tensor, attention: torch.Tensor) -> list[Any]:
    return [v for v, keep in zip(row.tolist(), attention.tolist(), strict=True) if keep]


def assert_trains_on_the_export(
    segment: dict[str, Any],
    prompts: Sequence[int],
    responses: Sequence[int],
    mask: Sequence[int],
    logprobs: Sequence[float],
) -> None:
    """What verl trains on is the segment's tokens, mask and logprobs."""
    tokens = SegmentTokens.of(segment)
    assert list(prompts) == tokens.prompt_ids
    assert list(responses) == tokens.response_ids
    assert list(mask) == tokens.response_mask
    assert list(logprobs) == pytest.approx(tokens.response_logprobs, abs=0, rel=1e-6)
    assert sum(mask) == tokens.sampled > 0


async def test_the_legacy_batch_is_the_export(
    servers: Servers, model: Path, tmp_path: Path, ray_cluster: None
) -> None:
    """Two rows, the example agent (the OpenAI SDK with a tool), `workers:
    verl`: verl's server manager lists the worker, the loop registers it,
    and verl's padded batch holds exactly each session's tokens."""
    config = verl_config(model, tmp_path, entry(servers, "solve", workers="verl"), use_v1=False)
    worker = LegacyWorker(config, balancer(servers.addresses))
    batch = await in_asyncio(
        lambda: worker.generate(rows(["Read the file a.txt.", "Read b.txt."]), global_steps=3)
    )
    listed = (await servers.client.get("/workers")).json()["workers"]
    assert [w["url"] for w in listed] == [w.url for w in servers.workers]
    tensors = batch.batch
    prompt_width = tensors["prompts"].shape[1]
    for i, info in enumerate(batch.non_tensor_batch["rollout_session"]):
        [segment] = (await servers.document(info["session_id"]))["segments"]
        attention = tensors["attention_mask"][i]
        response_attention = attention[prompt_width:]
        assert_trains_on_the_export(
            segment,
            unpadded(tensors["prompts"][i], attention[:prompt_width]),
            unpadded(tensors["responses"][i], response_attention),
            unpadded(tensors["response_mask"][i], response_attention),
            unpadded(tensors["rollout_log_probs"][i], response_attention),
        )
        # The agent called its tool: tool results are in the response, unmasked.
        assert segment["turns"][0]["finish_reason"] == "tool_calls"
        assert 0 in unpadded(tensors["response_mask"][i], response_attention)
        # verl's sampling, on every turn, whatever the SDK sent.
        pinned = {**VERL_SAMPLING, "max_tokens": 2048}
        for turn in segment["turns"]:
            assert {k: turn["sampling"][k] for k in pinned} == pinned
        # No step in the worker's labels, none in the legacy row: unknown.
        assert batch.non_tensor_batch["min_global_steps"][i] is None
        assert batch.non_tensor_batch["max_global_steps"][i] is None
        assert batch.non_tensor_batch["__num_turns__"][i] == len(segment["messages"])
    # The example agent leaves the reward to verl: no rm_scores from the loop.
    assert "rm_scores" not in tensors.keys()  # noqa: SIM118 (a TensorDict's keys)


async def test_v1_records_are_the_export_one_per_segment(
    servers: Servers, model: Path, tmp_path: Path, ray_cluster: None
) -> None:
    """An agent that rewrites its history: two segments, two records under
    v1, the main (last) one's reward copied to its sibling by verl; the
    agent's temperature is not what was sampled with."""
    config = verl_config(model, tmp_path, entry(servers, "rewriting", workers="verl"), use_v1=True)
    worker = V1Worker(config, balancer(servers.addresses))
    await in_asyncio(lambda: worker.run(first_row(["Plan a trip."]), global_steps=5))
    assert sorted(worker.records) == ["uid-0_0_0", "uid-0_0_1"]
    first, main = worker.records["uid-0_0_0"], worker.records["uid-0_0_1"]
    session_id = main["extra_fields"]["rollout_session"]["session_id"]
    segments = (await servers.document(session_id))["segments"]
    assert len(segments) == 2
    for record, segment in zip((first, main), segments, strict=True):
        assert_trains_on_the_export(
            segment,
            record["prompts"].tolist(),
            record["responses"].tolist(),
            record["response_mask"].tolist(),
            record["rollout_log_probs"].tolist(),
        )
        assert record["loss_mask"].tolist() == record["response_mask"].tolist()
        rm_scores = record["rm_scores"].tolist()
        assert rm_scores[-1] == agents.REWARD and not any(rm_scores[:-1])
    for key in ("uid-0_0_0", "uid-0_0_1"):
        assert worker.tags[key]["min_global_steps"] == worker.tags[key]["max_global_steps"] == 5
    assert main["extra_fields"]["rollout_session"]["segments"] == 2


def first_row(prompts: Sequence[str]) -> dict[str, Any]:
    """The first row of a batch, as v1 hands it to a loop (plain values)."""
    return {name: column[0] for name, column in rows(prompts).items()}


class _ActorGroup:
    """The actor side of verl's naive (colocated) weight update: the
    weights' transfer, which nothing here has; the test sees it called."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def update_weights(self, *, global_steps: int, mode: str) -> Any:
        assert mode == "naive"
        self.steps.append(global_steps)
        return ray.put(None)


async def test_a_weight_update_mid_turn_continues_it_at_the_new_step(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    model: Path,
    tmp_path: Path,
    ray_cluster: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verl's ``CheckpointEngineManager.update_weights`` with the hook
    installed (as ``custom_backend_module`` installs it: the session
    servers those the loops published on the cluster) lands while the
    episode's second turn is at the worker: the session servers pause
    (abort), the turn is continued after the resume, and the record spans
    the batch's step and the update's."""
    slow = EmulatorConfig(completion_tokens=120, decode_s_per_token=0.004, seed=7)
    async with start_servers(
        nursery, text_model, chat_tokenizers["chatml"], emulator=slow
    ) as servers:
        monkeypatch.setattr(
            CheckpointEngineManager, "update_weights", CheckpointEngineManager.update_weights
        )
        install_weight_sync()
        manager = object.__new__(CheckpointEngineManager)
        manager.backend = "naive"
        manager.actor_wg = _ActorGroup()
        config = verl_config(model, tmp_path, entry(servers, "solve", workers="verl"), use_v1=True)
        worker = V1Worker(config, balancer(servers.addresses))
        emulator = servers.workers[0].emulator
        async with trio.open_nursery() as episode:
            episode.start_soon(
                in_asyncio, lambda: worker.run(first_row(["Read a.txt."]), global_steps=6)
            )
            second_turn_midway = lambda: emulator.completed >= 1 and in_flight_midway(emulator, 5)  # noqa: E731
            async with stalled(emulator, second_turn_midway):
                await trio.to_thread.run_sync(lambda: manager.update_weights(global_steps=7))
        assert manager.actor_wg.steps == [7]
        [record] = worker.records.values()
        session_id = record["extra_fields"]["rollout_session"]["session_id"]
        [segment] = (await servers.document(session_id))["segments"]
        assert_trains_on_the_export(
            segment,
            record["prompts"].tolist(),
            record["responses"].tolist(),
            record["response_mask"].tolist(),
            record["rollout_log_probs"].tolist(),
        )
        assert emulator.aborted >= 1
        assert segment["turns"][1]["continuations"], "the interrupted turn was continued"
        [tags] = worker.tags.values()
        assert (tags["min_global_steps"], tags["max_global_steps"]) == (6, 7)
        assert record["metrics"]["num_preempted"] >= 1


async def test_an_agent_that_raises_drops_the_episode_and_closes_its_session(
    servers: Servers, model: Path, tmp_path: Path, ray_cluster: None
) -> None:
    """verl's worker sees the failure (as any failed agent loop), and no
    session is left open on the session server."""
    from rollout_session.trainers import EpisodeFailed

    config = verl_config(model, tmp_path, entry(servers, "raising", workers="verl"), use_v1=False)
    worker = LegacyWorker(config, balancer(servers.addresses))
    with pytest.raises(EpisodeFailed) as failed:
        await in_asyncio(lambda: worker.generate(rows(["Hello."]), global_steps=1))
    assert isinstance(failed.value.__cause__, agents.AgentBroke)
    assert (await servers.client.get("/health")).json()["sessions"] == 0


@pytest.mark.parametrize("use_v1", [False, True], ids=["legacy", "v1"])
async def test_routed_experts_in_verls_layout(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    model: Path,
    tmp_path: Path,
    ray_cluster: None,
    use_v1: bool,
) -> None:
    """R3 on (``enable_rollout_routing_replay``; the session servers with
    ``--routed-experts``): each position's experts, top-k from the model's
    config, in verl's (positions, layers, top_k) under the legacy padding
    and in the v1 record alike; zeros past what the engine reported."""
    async with start_servers(
        nursery, text_model, chat_tokenizers["chatml"], routed_experts=True
    ) as servers:
        config = verl_config(
            model,
            tmp_path,
            entry(servers, "scored", workers="verl"),
            use_v1=use_v1,
            overrides=["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"],
        )
        session_id, [experts] = await one_episode(servers, config, use_v1, "routed_experts")
        [segment] = (await servers.document(session_id))["segments"]
        exported = torch.tensor(routed(segment), dtype=torch.int16)
        reported = segment["routed_experts"]["shape"][0]
        assert exported.shape == (reported, 4, 2)
        assert torch.equal(experts[:reported], exported)
        assert not experts[reported:].any()


async def one_episode(
    servers: Servers, config: Any, use_v1: bool, *fields: str
) -> tuple[str, list[Any]]:
    """One episode of the row "Hi." at step 2 through verl's v1 path or its
    legacy batch; the session id and `fields` of what verl trains on, over
    the sequence's positions (the legacy batch's left padding cut off, its
    right padding kept)."""
    handle = balancer(servers.addresses)
    if use_v1:
        v1 = V1Worker(config, handle)
        await in_asyncio(lambda: v1.run(first_row(["Hi."]), global_steps=2))
        [record] = v1.records.values()
        session_id = record["extra_fields"]["rollout_session"]["session_id"]
        return session_id, [record[name] for name in fields]
    legacy = LegacyWorker(config, handle)
    batch = await in_asyncio(lambda: legacy.generate(rows(["Hi."]), global_steps=2))
    prompt_width = batch.batch["prompts"].shape[1]
    start = int((batch.batch["attention_mask"][0][:prompt_width] == 0).sum())
    session_id = batch.non_tensor_batch["rollout_session"][0]["session_id"]
    return session_id, [batch.batch[name][0][start:] for name in fields]


def routed(segment: dict[str, Any]) -> Any:
    """The segment's exported routed experts, top-k 2 (the emulator's)."""
    experts = routed_experts(segment, 2)
    assert experts is not None
    return experts.copy()


@pytest.mark.parametrize("use_v1", [False, True], ids=["legacy", "v1"])
async def test_a_teacher_fills_verls_distillation_fields(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    model: Path,
    tmp_path: Path,
    ray_cluster: None,
    use_v1: bool,
) -> None:
    """``teacher: LABEL``: the teacher workers score every position before
    the session is collected; verl's ``teacher_ids`` are the sequence's own
    ids and ``teacher_logprobs`` the teacher's scores, in verl's layout
    (padded as the legacy batch, unpadded in the v1 record)."""
    tokenizer = chat_tokenizers["chatml"]
    teacher = await spawn_worker(
        nursery,
        text_model,
        EmulatorConfig(seed=1000, skip_tokenizer_init=True, chat_template=tokenizer.chat_template),
        parsers=False,
    )
    async with start_servers(
        nursery, text_model, tokenizer, teacher_workers=(teacher.url,)
    ) as servers:
        config = verl_config(
            model, tmp_path, entry(servers, "scored", workers="verl", teacher="t"), use_v1=use_v1
        )
        session_id, [ids, logprobs] = await one_episode(
            servers, config, use_v1, "teacher_ids", "teacher_logprobs"
        )
        [segment] = (await servers.document(session_id))["segments"]
        scores = segment["rescores"]["t"]["logprobs"]
        length = len(segment["token_ids"])
        assert ids[:length].squeeze(-1).tolist() == segment["token_ids"]
        assert logprobs[:length].squeeze(-1).tolist() == pytest.approx(
            [0.0 if s is None else s for s in scores], rel=1e-6
        )
        assert scores[0] is None and all(s is not None for s in scores[1:])
