"""verl 0.9.1's agent-loop worker, run as verl runs it, beside real session
servers and emulator workers.

- `verl_config`: verl's own hydra config (``verl/trainer/config/
  ppo_trainer.yaml``) composed with the overrides a user sets, the agent
  loop registered in an ``agent_loop_config_path`` YAML as docs/trainers.md
  shows; the model a directory of the bundled tokenizer and a tiny config
  (no weights: nothing here runs a model).
- `LegacyWorker`: verl's ``AgentLoopWorker``: ``generate_sequences`` builds
  each loop with hydra (``_run_agent_loop``), runs it, and pads the batch the
  legacy trainer trains on (``_agent_loop_postprocess``, ``_postprocess``).
- `V1Worker`: the same worker with the v1 trainer's post-processing
  (``verl/trainer/ppo/v1/agent_loop_tq.py`` ``AgentLoopWorkerTQ.
  _agent_loop_postprocess``, verl's own function), whose TransferQueue put
  is captured: the records the v1 trainer reads.
- `balancer`: verl's ``GlobalRequestLoadBalancer`` as a Ray actor on a
  local cluster, listing the workers by address as verl's server manager
  does (``LLMServerClient`` holds it).

verl's code is asyncio; a trio test runs it on a thread (`in_asyncio`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import ray
import transfer_queue
import trio
import verl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.router import GlobalRequestLoadBalancer

from rollout_session.emulator import bundled_tokenizer_path
from rollout_session.trainers.verl.loop import close_clients

__all__ = [
    "LOOP",
    "LegacyWorker",
    "V1Worker",
    "balancer",
    "in_asyncio",
    "model_dir",
    "rows",
    "verl_config",
]

T = TypeVar("T")

# The agent loop's name in the YAML; a dataset row names it in agent_name.
LOOP = "rollout_session"

# A tiny MoE config (Qwen3-MoE): its num_experts_per_tok is the routed
# experts' top-k the adapter reads, as the emulator's (2) over 4 layers.
_MODEL_CONFIG = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 64,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
}


def model_dir(root: Path) -> Path:
    """The bundled tokenizer (its ChatML template) and a config, as a model path."""
    path = root / "model"
    shutil.copytree(bundled_tokenizer_path(), path)
    (path / "config.json").write_text(json.dumps(_MODEL_CONFIG))
    return path


def verl_config(
    model: Path,
    root: Path,
    entry: Mapping[str, Any],
    *,
    use_v1: bool,
    overrides: Sequence[str] = (),
) -> DictConfig:
    """verl's trainer config with the agent loop `entry` registered."""
    loops = root / "agent_loops.yaml"
    loops.write_text(
        json.dumps(
            [{"name": LOOP, "_target_": "rollout_session.trainers.verl.SessionAgentLoop", **entry}]
        )
    )
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config: DictConfig = compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model}",
                "actor_rollout_ref.rollout.name=sglang",
                "actor_rollout_ref.rollout.calculate_log_probs=true",
                "actor_rollout_ref.rollout.prompt_length=2048",
                "actor_rollout_ref.rollout.response_length=2048",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
                f"trainer.use_v1={'true' if use_v1 else 'false'}",
                *overrides,
            ],
        )
    return config


def balancer(addresses: Sequence[str]) -> Any:
    """verl's load balancer actor holding `addresses` (``host:port``)."""
    actor = ray.remote(GlobalRequestLoadBalancer)
    return actor.remote(servers=dict.fromkeys(addresses))


def rows(prompts: Sequence[str], **columns: Any) -> dict[str, np.ndarray]:
    """A batch's non-tensor columns as verl's RLHFDataset gives them."""
    raw = np.empty(len(prompts), dtype=object)
    raw[:] = [[{"role": "user", "content": p}] for p in prompts]
    batch = {
        "raw_prompt": raw,
        "agent_name": np.array([LOOP] * len(prompts), dtype=object),
        "index": np.arange(len(prompts)),
        "uid": np.array([f"uid-{i}" for i in range(len(prompts))], dtype=object),
    }
    for name, values in columns.items():
        column = np.empty(len(prompts), dtype=object)
        column[:] = list(values)
        batch[name] = column
    return batch


class LegacyWorker:
    """verl's ``AgentLoopWorker`` over `server_manager`: the legacy trainer's batch."""

    def __init__(self, config: DictConfig, balancer_handle: Any) -> None:
        self.config = config
        self.worker = AgentLoopWorker(
            config, llm_client=LLMServerClient(config, load_balancer_handle=balancer_handle)
        )

    async def generate(self, columns: Mapping[str, np.ndarray], global_steps: int) -> DataProto:
        batch = DataProto.from_dict(
            non_tensors=dict(columns), meta_info={"global_steps": global_steps}
        )
        return await self.worker.generate_sequences(batch)


class _TQPostprocessing(AgentLoopWorker):  # type: ignore[misc]
    """``AgentLoopWorker`` with the v1 trainer's post-processing (verl's
    ``AgentLoopWorkerTQ._agent_loop_postprocess``, unchanged)."""

    _agent_loop_postprocess = AgentLoopWorkerTQ.__ray_metadata__.modified_class.__dict__[
        "_agent_loop_postprocess"
    ]


class V1Worker:
    """The v1 path: each loop built and run by verl's ``_run_agent_loop`` as
    ``AgentLoopWorkerTQ._run_prompt`` calls it (``session_id`` the rollout
    index), its outputs post-processed by verl into TransferQueue records,
    captured here."""

    def __init__(self, config: DictConfig, balancer_handle: Any) -> None:
        self.config = config
        self.worker = _TQPostprocessing(
            config, llm_client=LLMServerClient(config, load_balancer_handle=balancer_handle)
        )
        self.records: dict[str, dict[str, Any]] = {}
        self.tags: dict[str, dict[str, Any]] = {}

    async def _put(
        self, *, keys: list[str], fields: Any, tags: list[dict[str, Any]], partition_id: str
    ) -> None:
        del partition_id
        for i, key in enumerate(keys):
            self.records[key] = {name: fields[name][i] for name in fields.keys()}  # noqa: SIM118
            self.tags[key] = tags[i]

    async def run(self, row: Mapping[str, Any], *, global_steps: int, n: int = 1) -> None:
        rollout = self.config.actor_rollout_ref.rollout
        sampling = {
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
            "repetition_penalty": 1.0,
            "logprobs": rollout.calculate_log_probs,
        }
        trajectory = {"step": global_steps, "sample_index": 0, "rollout_n": 0, "validate": False}
        put = transfer_queue.async_kv_batch_put
        transfer_queue.async_kv_batch_put = self._put
        try:
            await asyncio.gather(
                *(
                    self.worker._run_agent_loop(
                        dict(sampling),
                        trajectory=trajectory,
                        trace=False,
                        session_id=i,
                        global_steps=global_steps,
                        **row,
                    )
                    for i in range(n)
                )
            )
        finally:
            transfer_queue.async_kv_batch_put = put


async def in_asyncio(work: Callable[[], Awaitable[T]]) -> T:
    """`work()` on an asyncio loop of its own on a thread (verl's code is
    asyncio); the loops' shared session-server clients closed after it."""

    async def run() -> T:
        try:
            return await work()
        finally:
            await close_clients()

    return await trio.to_thread.run_sync(asyncio.run, run())
