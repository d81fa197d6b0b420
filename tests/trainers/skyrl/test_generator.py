"""`SessionGenerator` against the released SkyRL 0.4.0 (docs/trainers.md#skyrl).

The generator is built as SkyRL's experiment builds it (``get_generator``
of `SessionPPOExp`, its config parsed from a command line by SkyRL's own
parser), on SkyRL's own ``RemoteInferenceClient`` over vLLM emulator
workers launched as SkyRL launches vLLM (``--enable-scale-out``,
``VLLM_SERVER_DEV_MODE``, ``generation_config="vllm"``: its
``inference_servers/vllm_server_actor.py`` and ``utils.py``), and awaited
under asyncio as SkyRL's trainer awaits it, with a batch made by SkyRL's
``prepare_generator_input``. Its output goes through SkyRL's own
``validate_generator_output``, ``postprocess_generator_output`` and
``convert_to_training_input``, and the batch SkyRL would train on is
compared, row by row, with the sessions' exports. The weight sync is
SkyRL's own dispatch code (the simulated trainer's ``_SimDispatch``:
pause, resume, count) through that client, wrapped by the adapter's hook.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.emulator.worker import Emulator
from rollout_session.trainers import EpisodeFailed
from tests.stalls import in_flight_midway, until
from tests.trainers.skyrl import require_skyrl
from tests.trainers.threaded import TrainerStack, TrioThread

require_skyrl()

from skyrl.backends.skyrl_train.inference_servers.engine_utils import (  # noqa: E402
    get_sampling_params_for_backend,
)
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (  # noqa: E402
    RemoteInferenceClient,
)
from skyrl.train.fully_async_trainer_sim import _SimDispatch  # noqa: E402
from skyrl.train.generators.utils import prepare_generator_input  # noqa: E402
from skyrl.train.trainer import RayPPOTrainer  # noqa: E402
from skyrl.train.utils.trainer_utils import validate_generator_output  # noqa: E402

from rollout_session.trainers.skyrl.experiment import SessionPPOExp, config_of  # noqa: E402
from rollout_session.trainers.skyrl.generator import SessionGenerator  # noqa: E402

# vLLM as SkyRL launches it, with the tool parser a tool agent needs
# (generator.inference_engine.engine_init_kwargs: enable_auto_tool_choice,
# tool_call_parser).
VLLM = EmulatorConfig(
    engine="vllm",
    enable_scale_out=True,
    dev_mode=True,
    generation_config="vllm",
    tool_call_parser="hermes",
)
SERVER: dict[str, Any] = {"engine": "vllm", "tool_call_parser": "hermes"}
PROMPTS = 2
SAMPLES = 2
# SkyRL's sampling for the batch (the agent sends temperature 0.3).
SAMPLING = [
    "generator.sampling_params.temperature=0.7",
    "generator.sampling_params.top_p=0.9",
    "generator.sampling_params.top_k=20",
    "generator.sampling_params.max_generate_length=64",
]


@pytest.fixture(scope="module")
def trio_thread() -> Iterator[TrioThread]:
    with TrioThread() as thread:
        yield thread


StackMaker = Callable[..., TrainerStack]


@pytest.fixture
def make_stack(trio_thread: TrioThread, text_model: TextModel) -> StackMaker:
    def make(emulator: EmulatorConfig = VLLM, **settings: Any) -> TrainerStack:
        return TrainerStack.start(trio_thread, text_model, emulator, **{**SERVER, **settings})

    return make


def skyrl_config(stack: TrainerStack, agent: str, *overrides: str) -> Any:
    """SkyRL's config of the run, parsed as SkyRL's entrypoint would hand it
    over (``trainer.override_entrypoint`` chose this experiment)."""
    return config_of(
        [
            "trainer.override_entrypoint=rollout_session.trainers.skyrl.experiment",
            f'generator.rollout_session.servers=["{stack.url}"]',
            f"generator.rollout_session.agent=tests.trainers.agents:{agent}",
            f"generator.n_samples_per_prompt={SAMPLES}",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            *SAMPLING,
            *overrides,
        ]
    )


def skyrl_batch(cfg: Any, global_step: int = 1) -> tuple[dict[str, Any], list[str]]:
    """A training batch as SkyRL's trainer makes one (trainer.py ``train``)."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What does main.py print? ({i})"}],
            "env_class": None,
            "env_extras": {"extra_info": {"index": i}},
            "uid": f"prompt-{i}",
        }
        for i in range(PROMPTS)
    ]
    batch, uids = prepare_generator_input(
        rows,
        cfg.generator.n_samples_per_prompt,
        get_sampling_params_for_backend("vllm", cfg.generator.sampling_params),
        cfg.environment.env_class,
        "train",
        global_step,
    )
    return batch, uids


def inference_client(stack: TrainerStack, **kwargs: Any) -> Any:
    return RemoteInferenceClient(
        proxy_url=stack.worker_urls[0],
        server_urls=stack.worker_urls,
        data_parallel_size=1,
        **kwargs,
    )


def build(cfg: Any, tokenizer: Any, client: Any, **kwargs: Any) -> Any:
    """The generator as SkyRL's experiment builds it (``get_generator``; its
    __init__ loads datasets and a model's tokenizer, not what is tested
    here), or with keyword arguments over the config."""
    if kwargs:
        return SessionGenerator(cfg, tokenizer, client, **kwargs)
    return object.__new__(SessionPPOExp).get_generator(cfg, tokenizer, client)


async def generate(
    cfg: Any,
    tokenizer: Any,
    stack: TrainerStack,
    batch: dict[str, Any],
    during: Callable[[Any, asyncio.Event], Awaitable[None]] | None = None,
    **kwargs: Any,
) -> Any:
    """The generator's output for `batch`; with `during(client, start)`,
    ``generate()`` waits for that coroutine to set `start`, and the rest of
    it runs alongside."""
    client = inference_client(
        stack,
        enable_return_routed_experts=cfg.generator.inference_engine.enable_return_routed_experts,
    )
    generator = build(cfg, tokenizer, client, **kwargs)
    try:
        if during is None:
            return await generator.generate(batch)
        started = asyncio.Event()

        async def later() -> Any:
            await started.wait()
            return await generator.generate(batch)

        task = asyncio.create_task(later())
        await during(client, started)
        return await task
    finally:
        await generator.aclose()
        await client.teardown()


def trainer_of(cfg: Any, tokenizer: Any) -> Any:
    """SkyRL's trainer, as far as its post-processing of a generator's
    output reads it (no models: the simulated trainer's dispatch)."""
    trainer = object.__new__(RayPPOTrainer)
    trainer.cfg = cfg
    trainer.tokenizer = tokenizer
    trainer.all_metrics = {}
    trainer.dispatch = _SimDispatch(None, 0)
    return trainer


def trained_batch(cfg: Any, tokenizer: Any, output: Any, uids: list[str], prompts: int) -> Any:
    """What SkyRL trains on: its validation, post-processing and conversion
    of the output, as ``RayPPOTrainer.train`` applies them."""
    validate_generator_output(
        prompts,
        output,
        step_wise=cfg.generator.step_wise_trajectories,
        routes_expected=cfg.generator.inference_engine.enable_return_routed_experts,
    )
    if cfg.generator.step_wise_trajectories:
        uids = [tid.instance_id for tid in output["trajectory_ids"]]
    trainer = trainer_of(cfg, tokenizer)
    output = {k: v for k, v in output.items() if k != "rollout_metrics"}
    output, uids = trainer.postprocess_generator_output(output, uids)
    return trainer.convert_to_training_input(output, uids)


def export(stack: TrainerStack, session_id: str) -> dict[str, Any]:
    """A collected session's export (the server keeps it readable)."""
    answer = stack.admin("GET", f"/sessions/{session_id}/trajectory")
    assert answer.status_code == 200, answer.text
    doc: dict[str, Any] = answer.json()
    assert doc["status"] == "closed"
    return doc


def exports(stack: TrainerStack, output: Any) -> list[dict[str, Any]]:
    """Each row's session, in row order (a row's ``env_metrics`` names it)."""
    return [export(stack, metrics["session_id"]) for metrics in output["env_metrics"]]


def check_batch(
    batch: Any, expected: Sequence[tuple[list[int], list[int], list[int], list[float]]]
) -> None:
    """Each row of SkyRL's training batch holds exactly `expected`'s
    (prompt ids, response ids, loss mask, logprobs): the real positions of
    ``sequences`` (left-padded), and the right-aligned response tensors."""
    sequences = batch["sequences"].numpy()
    attention = batch["attention_mask"].numpy().astype(bool)
    loss = batch["loss_mask"].numpy()
    logprobs = batch["rollout_logprobs"].numpy()
    width = loss.shape[1]
    assert len(expected) <= len(sequences)
    for i, (prompt, response, mask, lps) in enumerate(expected):
        assert sequences[i][attention[i]].tolist() == prompt + response
        assert loss[i][width - len(response) :].tolist() == mask
        assert not loss[i][: width - len(response)].any()
        assert (
            logprobs[i][width - len(response) :].tolist()
            == np.asarray(lps, dtype=np.float32).tolist()
        )


def output_row(output: Any, i: int) -> tuple[Any, Any, Any, Any]:
    """Row `i` of a ``GeneratorOutput``: its ids, mask and logprobs, as `segment_rows`."""
    return (
        output["prompt_token_ids"][i],
        output["response_ids"][i],
        output["loss_masks"][i],
        output["rollout_logprobs"][i],
    )


def segment_rows(doc: dict[str, Any]) -> list[tuple[list[int], list[int], list[int], list[float]]]:
    """Each segment as a trajectory row: (prompt, response, mask, logprobs)."""
    rows = []
    for segment in doc["segments"]:
        cut = segment["prompt_length"]
        ids = segment["token_ids"]
        rows.append((ids[:cut], ids[cut:], segment["loss_mask"][cut:], segment["logprobs"][cut:]))
    return rows


def step_records(stack: TrainerStack, session_id: str) -> list[dict[str, Any]]:
    """The server's own steps view of a collected session."""
    answer = stack.admin("GET", f"/sessions/{session_id}/trajectory", params={"format": "steps"})
    assert answer.status_code == 200, answer.text
    steps: list[dict[str, Any]] = answer.json()["steps"]
    return steps


def test_trajectory_rows_are_the_sessions_exports(
    make_stack: StackMaker, hf_tokenizer: Any
) -> None:
    stack = make_stack()
    cfg = skyrl_config(stack, "tool_agent")
    batch, uids = skyrl_batch(cfg)
    output = asyncio.run(generate(cfg, hf_tokenizer, stack, batch))

    # One row per prompt, in the batch's order, trajectory ids kept.
    assert output["trajectory_ids"] == batch["trajectory_ids"]
    docs = exports(stack, output)
    assert len({doc["session_id"] for doc in docs}) == PROMPTS * SAMPLES
    for doc, tid in zip(docs, batch["trajectory_ids"], strict=True):
        assert doc["metadata"]["instance_id"] == tid.instance_id
        assert doc["metadata"]["repetition_id"] == tid.repetition_id
        assert doc["metadata"]["trainer"] == "skyrl"
    expected = []
    for i, doc in enumerate(docs):
        (segment,) = doc["segments"]
        (row,) = segment_rows(doc)
        expected.append(row)
        assert output_row(output, i) == row
        # The tool call and the answer after its result: both turns sampled.
        assert len(segment["turns"]) == 2
        assert 0 in row[2] and 1 in row[2]
        # SkyRL's sampling, pinned: not the agent's 0.3.
        for turn in segment["turns"]:
            sampling = turn["sampling"]
            assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.7, 0.9, 20)
            assert sampling["max_tokens"] == 64
    assert output["rewards"] == [1.0] * len(docs)
    assert output["stop_reasons"] == ["stop"] * len(docs)
    assert output["is_last_step"] is None
    assert output["rollout_metrics"]["rollout_session/turns_per_episode"] == 2.0

    # The inference client's second server, registered by the generator
    # and admitted by the session server.
    workers = stack.admin("GET", "/workers").json()["workers"]
    assert {w["url"]: w["healthy"] for w in workers} == dict.fromkeys(stack.worker_urls, True)

    trained = trained_batch(cfg, hf_tokenizer, output, uids, len(batch["prompts"]))
    check_batch(trained, expected)
    # The agent's reward on the last response token (SkyRL's per-token rewards).
    rewards = trained["rewards"].numpy()
    assert rewards[:, -1].tolist() == [1.0] * len(docs)
    assert not rewards[:, :-1].any()


def test_step_wise_rows_are_the_steps_view(make_stack: StackMaker, hf_tokenizer: Any) -> None:
    stack = make_stack()
    cfg = skyrl_config(stack, "tool_agent", "generator.step_wise_trajectories=true")
    batch, uids = skyrl_batch(cfg)
    output = asyncio.run(generate(cfg, hf_tokenizer, stack, batch))

    rows = list(
        zip(
            output["prompt_token_ids"],
            output["response_ids"],
            output["loss_masks"],
            output["rollout_logprobs"],
            strict=True,
        )
    )
    sessions = list(dict.fromkeys(m["session_id"] for m in output["env_metrics"]))
    assert len(sessions) == PROMPTS * SAMPLES
    at = 0
    for k, session_id in enumerate(sessions):
        steps = step_records(stack, session_id)
        assert len(steps) == 2
        for step in steps:
            assert rows[at] == (
                step["prompt_ids"],
                step["response_ids"],
                step["response_mask"],
                step["response_logprobs"],
            )
            assert output["trajectory_ids"][at] == batch["trajectory_ids"][k]
            assert output["is_last_step"][at] is step["is_last"]
            # The reward on the episode's last step; SkyRL propagates it.
            assert output["rewards"][at] == (1.0 if step["is_last"] else 0.0)
            at += 1
    assert at == len(rows)
    trained = trained_batch(cfg, hf_tokenizer, output, uids, len(batch["prompts"]))
    check_batch(trained, rows)

    # SkyRL's prefix-aware merge makes each segment its trajectory row again.
    merged_cfg = skyrl_config(
        stack,
        "tool_agent",
        "generator.step_wise_trajectories=true",
        "generator.merge_stepwise_output=true",
    )
    merged = trained_batch(merged_cfg, hf_tokenizer, output, uids, len(batch["prompts"]))
    check_batch(merged, [row for sid in sessions for row in segment_rows(export(stack, sid))])


def test_a_rewritten_history(
    make_stack: StackMaker, hf_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    stack = make_stack()

    # Step-wise: both segments' turns are rows, in order; nothing sampled is lost.
    cfg = skyrl_config(stack, "rewriting_agent", "generator.step_wise_trajectories=true")
    batch, uids = skyrl_batch(cfg)
    output = asyncio.run(generate(cfg, hf_tokenizer, stack, batch))
    sessions = list(dict.fromkeys(m["session_id"] for m in output["env_metrics"]))
    at = 0
    for session_id in sessions:
        doc = export(stack, session_id)
        assert doc["num_segments"] == 2
        assert doc["segments"][1]["branch"]["reason"] == "history_edited"
        for segment in doc["segments"]:
            (turn,) = segment["turns"]
            cut = turn["completion_start"]
            assert output["prompt_token_ids"][at] == segment["token_ids"][:cut]
            assert output["response_ids"][at] == segment["token_ids"][cut:]
            assert output["rollout_logprobs"][at] == segment["logprobs"][cut:]
            at += 1
        assert output["rewards"][at - 1] == 0.5 and output["is_last_step"][at - 1] is True
    assert at == len(output["response_ids"])
    trained_batch(cfg, hf_tokenizer, output, uids, len(batch["prompts"]))

    # Trajectory rows: no single row holds two segments; masked, and said.
    cfg = skyrl_config(stack, "rewriting_agent")
    batch, uids = skyrl_batch(cfg)
    with caplog.at_level(logging.WARNING, logger="rollout_session.trainers"):
        output = asyncio.run(generate(cfg, hf_tokenizer, stack, batch))
    assert output["loss_masks"] == [[0]] * len(batch["prompts"])
    assert output["stop_reasons"] == ["error"] * len(batch["prompts"])
    assert output["rollout_metrics"]["rollout_session/masked_episodes"] == len(batch["prompts"])
    said = [r.getMessage() for r in caplog.records if "rewrote its history" in r.getMessage()]
    assert len(said) == len(batch["prompts"])
    assert all("step_wise_trajectories=true" in s and "2 segments" in s for s in said)
    trained_batch(cfg, hf_tokenizer, output, uids, len(batch["prompts"]))

    # ... or the batch fails, with the same reason.
    with pytest.raises(EpisodeFailed, match="rewrote its history"):
        asyncio.run(generate(cfg, hf_tokenizer, stack, batch, on_error="raise"))


def _open_sessions(stack: TrainerStack) -> list[str]:
    listed = stack.admin("GET", "/sessions", params={"state": "open"}).json()["sessions"]
    return [s["session_id"] for s in listed]


def test_an_agent_that_raises(
    make_stack: StackMaker, hf_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    stack = make_stack()
    cfg = skyrl_config(stack, "raising_agent")
    batch, uids = skyrl_batch(cfg)
    with caplog.at_level(logging.WARNING, logger="rollout_session.trainers"):
        output = asyncio.run(generate(cfg, hf_tokenizer, stack, batch))
    count = len(batch["prompts"])
    # Each a row that trains nothing, said with the agent's error; no
    # session left open.
    assert output["loss_masks"] == [[0]] * count
    assert output["rewards"] == [0.0] * count
    assert [m["masked"] is not None for m in output["env_metrics"]] == [True] * count
    said = [r.getMessage() for r in caplog.records if "the agent failed" in r.getMessage()]
    assert len(said) == count and all("the tool sandbox died" in s for s in said)
    assert _open_sessions(stack) == []
    trained_batch(cfg, hf_tokenizer, output, uids, count)

    with pytest.raises(EpisodeFailed, match="the tool sandbox died"):
        asyncio.run(generate(cfg, hf_tokenizer, stack, batch, on_error="raise"))
    assert _open_sessions(stack) == []

    # An agent that returns no reward: SkyRL has nothing to train it on.
    cfg = skyrl_config(stack, "silent_agent", "generator.rollout_session.on_error=raise")
    with pytest.raises(EpisodeFailed, match="returned no reward"):
        asyncio.run(generate(cfg, hf_tokenizer, stack, skyrl_batch(cfg)[0]))


# Slow enough to catch a turn midway: 120 tokens at 4 ms.
SLOW = EmulatorConfig(**{**VLLM.__dict__, "decode_s_per_token": 0.004, "completion_tokens": 120})


async def _freeze_midway(emulators: Sequence[Emulator]) -> None:
    """Once a turn is midway at some worker, stall every worker's GPU, the
    turn where it was seen (tests/integration/engines/test_weight_updates.py
    ``stalled``: on a loaded machine a window of decode time is not enough)."""

    def midway() -> bool:
        return any(in_flight_midway(e, at_least=8) for e in emulators)

    while True:
        await until(midway)
        for emulator in emulators:
            emulator.gpu.freeze()
        if midway():
            return
        for emulator in emulators:
            emulator.gpu.thaw()


def test_a_weight_sync_mid_batch(make_stack: StackMaker, hf_tokenizer: Any) -> None:
    stack = make_stack(SLOW)
    emulators = [w.emulator for w in stack.workers]
    cfg = skyrl_config(stack, "tool_agent", "generator.sampling_params.max_generate_length=512")
    batch, uids = skyrl_batch(cfg)

    async def sync_midway(client: Any, start: asyncio.Event) -> None:
        dispatch = _SimDispatch(client, 0)
        await dispatch.save_weights_for_sampler()  # SkyRL's sync before training: policy 1
        start.set()
        await asyncio.to_thread(stack.thread.run, _freeze_midway, emulators)
        await dispatch.save_weights_for_sampler()  # mid-batch: policy 2
        assert client.weight_version == 2
        for emulator in emulators:
            stack.thread.run_sync(emulator.gpu.thaw)

    output = asyncio.run(generate(cfg, hf_tokenizer, stack, batch, during=sync_midway))

    # SkyRL paused its vLLM servers (keep) twice, through its own client.
    assert [e.weights.pauses["keep"] for e in emulators] == [2, 2]
    docs = exports(stack, output)
    interrupted = [
        turn for doc in docs for turn in doc["segments"][0]["turns"] if turn["continuations"]
    ]
    # The turn the sync met midway: interrupted by the session server,
    # continued after it, its tokens named by SkyRL's policy versions (a
    # turn caught before its first token has only the new one).
    assert ["1", "2"] in [
        [span["version"] for span in turn["weight_versions"]] for turn in interrupted
    ]
    for turn in interrupted:
        assert [span["version"] for span in turn["weight_versions"]] in (["1", "2"], ["2"])
    versions = {
        span["version"]
        for doc in docs
        for turn in doc["segments"][0]["turns"]
        for span in turn["weight_versions"]
    }
    assert versions == {"1", "2"}
    metrics = output["rollout_metrics"]
    assert (
        metrics["rollout_session/min_weight_version"],
        metrics["rollout_session/max_weight_version"],
    ) == (1, 2)
    assert metrics["rollout_session/continuations"] >= 1
    expected = [segment_rows(doc)[0] for doc in docs]
    for i, row in enumerate(expected):
        assert output_row(output, i) == row
    check_batch(trained_batch(cfg, hf_tokenizer, output, uids, len(batch["prompts"])), expected)


R3 = EmulatorConfig(**{**VLLM.__dict__, "return_routed_experts": True})


@pytest.mark.parametrize("step_wise", [False, True], ids=["trajectory", "step-wise"])
def test_routed_experts(make_stack: StackMaker, hf_tokenizer: Any, step_wise: bool) -> None:
    stack = make_stack(R3, routed_experts=True)
    cfg = skyrl_config(
        stack,
        "tool_agent",
        "generator.inference_engine.enable_return_routed_experts=true",
        f"generator.rollout_session.experts_top_k={R3.routed_experts_top_k}",
        f"generator.step_wise_trajectories={str(step_wise).lower()}",
    )
    batch, uids = skyrl_batch(cfg)
    output = asyncio.run(generate(cfg, hf_tokenizer, stack, batch))
    routes = output["rollout_expert_indices"]
    layers, top_k = R3.routed_experts_layers, R3.routed_experts_top_k
    sessions = [m["session_id"] for m in output["env_metrics"]]
    for i, session_id in enumerate(sessions):
        (segment,) = export(stack, session_id)["segments"]
        blob = segment["routed_experts"]
        full = np.frombuffer(
            __import__("base64").b64decode(blob["data"]), dtype=np.dtype(blob["dtype"])
        ).reshape(blob["shape"][0], layers, top_k)
        length = len(output["prompt_token_ids"][i]) + len(output["response_ids"][i])
        assert routes[i].shape[1:] == (layers, top_k)
        # Every position the engine forwarded: all but the row's last token.
        assert routes[i].shape[0] == min(length, len(full)) >= length - 1
        assert routes[i].tolist() == full[: routes[i].shape[0]].tolist()
    trained = trained_batch(cfg, hf_tokenizer, output, uids, len(batch["prompts"]))
    packed = trained["rollout_expert_indices"]
    offsets = packed.cu_seqlens.tolist()
    for i in range(len(sessions)):
        assert (
            packed.values[offsets[i] : offsets[i] + routes[i].shape[0]].tolist()
            == routes[i].tolist()
        )
