"""`SessionAgentLoop`: verl's agent loop that rolls out through sessions
(docs/trainers.md#verl).

verl 0.9.1 builds an agent loop per trajectory with hydra from the entry of
``actor_rollout_ref.rollout.agent.agent_loop_config_path`` a dataset row
names in its ``agent_name`` column (``verl/experimental/agent_loop/
agent_loop.py`` ``AgentLoopWorker._run_agent_loop``): the entry's extra keys
are constructor arguments, and ``run(sampling_params, **row)`` is awaited.
This loop runs the user's agent in a session of the session servers, with
verl's sampling pinned on it, and returns the session's export as verl's
outputs (`outputs.verl_outputs`): a list, one per segment, under the v1
trainer (``trainer.use_v1``, verl's default); the last segment under the
legacy one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
)

from ...client import SessionClient
from ..agent import load_agent
from ..episode import run_episode
from ..segments import experts_top_k as model_experts_top_k
from ..workers import WorkerSync
from .outputs import Limits, verl_outputs
from .servers import verl_server_addresses
from .weight_sync import publish_servers

__all__ = ["SessionAgentLoop", "close_clients"]

logger = logging.getLogger("rollout_session.trainers")


@dataclass
class _Process:
    """What the loops of one process share: verl builds a loop per
    trajectory, and one client and one view of the registered workers
    serve them all."""

    client: SessionClient
    workers: WorkerSync


_Key = tuple[tuple[str, ...], str | None, str | None]

# Per event loop (an HTTP client belongs to the loop it was made on; verl
# runs one per agent-loop worker), per session servers and keys.
_processes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[_Key, _Process]] = (
    weakref.WeakKeyDictionary()
)


def _process(servers: tuple[str, ...], api_key: str | None, admin_api_key: str | None) -> _Process:
    shared = _processes.setdefault(asyncio.get_running_loop(), {})
    key = (servers, api_key, admin_api_key)
    if key not in shared:
        client = SessionClient(servers, api_key=api_key)
        shared[key] = _Process(client, WorkerSync(client, api_key=admin_api_key))
    return shared[key]


async def close_clients() -> None:
    """Close the session-server clients the loops of this event loop share
    (at a worker's shutdown; the next loop makes new ones)."""
    for process in _processes.pop(asyncio.get_running_loop(), {}).values():
        await process.client.aclose()


class SessionAgentLoop(AgentLoopBase):  # type: ignore[misc]
    """Registered as ``_target_: rollout_session.trainers.verl.SessionAgentLoop``
    with ``servers`` (the session servers' URLs), ``agent``
    (``"package.module:function"``), ``workers`` (``verl``: verl's rollout
    servers; a list of URLs; null: the session servers have theirs) and,
    optionally, ``teacher`` (a rescore label), ``api_key`` /
    ``admin_api_key`` (the session servers' trainer and operator keys) and
    ``experts_top_k`` (with routed-expert replay, when the model's config
    does not say ``num_experts_per_tok``), ``weight_sync`` (``abort``, the
    default, or ``drain``: how verl's weight update pauses the session
    servers, once its hook is installed: `weight_sync`; null: not at all)."""

    def __init__(
        self,
        trainer_config: Any,
        server_manager: Any,
        tokenizer: Any = None,
        processor: Any = None,
        dataset_cls: Any = None,
        data_config: Any = None,
        hf_model_type: str | None = None,
        *,
        servers: Sequence[str],
        agent: str,
        workers: str | Sequence[str] | None = "verl",
        teacher: str | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        experts_top_k: int | None = None,
        weight_sync: Literal["abort", "drain"] | None = "abort",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            trainer_config,
            server_manager,
            tokenizer,
            processor,
            dataset_cls,
            data_config,
            hf_model_type,
            **kwargs,
        )
        config = self.config
        rollout = config.actor_rollout_ref.rollout
        self._servers = tuple(str(s).rstrip("/") for s in servers)
        self._agent = load_agent(agent)
        if workers is not None and not isinstance(workers, str):
            workers = [str(w) for w in workers]
        elif workers not in (None, "verl"):
            raise TypeError(f"workers: 'verl', a list of URLs, or null; not {workers!r}")
        self._workers = workers
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        if weight_sync not in ("abort", "drain", None):
            raise TypeError(f"weight_sync: 'abort', 'drain' or null; not {weight_sync!r}")
        self._weight_sync: Literal["abort", "drain"] | None = weight_sync
        replay = bool(rollout.get("enable_rollout_routing_replay", False))
        self._limits = Limits(
            prompt_length=int(rollout.prompt_length),
            response_length=int(rollout.response_length),
            every_segment=bool(config.trainer.get("use_v1", False)),
            experts_top_k=(
                (experts_top_k or model_experts_top_k(str(config.actor_rollout_ref.model.path)))
                if replay
                else None
            ),
            teacher=teacher,
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        process = _process(self._servers, self._api_key, self._admin_api_key)
        _publish(self._servers, self._weight_sync, self._admin_api_key)
        await self._register_workers(process.workers)
        row = {k: _plain(v) for k, v in kwargs.items()}
        global_steps = row.get("global_steps")
        episode = await run_episode(
            process.client,
            self._agent,
            row,
            sampling=self._sampling(sampling_params),
            metadata={"trainer": "verl", "uid": str(row.get("uid", ""))},
            teacher=self._limits.teacher,
        )
        limits = dataclasses.replace(
            self._limits,
            global_steps=int(global_steps) if isinstance(global_steps, int) else None,
        )
        outputs = verl_outputs(episode, limits, AgentLoopOutput, AgentLoopMetrics)
        return outputs if limits.every_segment else outputs[-1]

    async def _register_workers(self, sync: WorkerSync) -> None:
        if self._workers is None or not sync.due():
            return
        if self._workers == "verl":
            await sync.sync(await verl_server_addresses(self.server_manager))
        else:
            await sync.sync(self._workers)

    def _sampling(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """verl's sampling parameters, pinned on the session; a turn's cap is
        the whole response's (``rollout.response_length``)."""
        pinned = {
            key: params[key]
            for key in ("temperature", "top_p", "top_k", "repetition_penalty")
            if params.get(key) is not None
        }
        pinned["max_tokens"] = self._limits.response_length
        return pinned


@functools.cache
def _publish(
    servers: tuple[str, ...], mode: Literal["abort", "drain"] | None, api_key: str | None
) -> None:
    """Once per process: the trainer's weight-sync hook learns the servers."""
    publish_servers(servers, mode, api_key)


def _plain(value: Any) -> Any:
    """A dataset field as plain Python (verl hands numpy objects and arrays)."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value
