"""`SessionGenerator`: SkyRL's generator that rolls out through sessions
(docs/trainers.md#skyrl).

SkyRL 0.4.0 awaits ``generate(input_batch)`` of its generator
(``skyrl/train/generators/base.py`` ``GeneratorInterface``) with a batch of
prompts, one per trajectory (``n_samples_per_prompt`` copies each, told
apart by ``trajectory_ids``), its sampling parameters and the batch's
``global_step``, and trains on the ``GeneratorOutput`` in the batch's
order. This generator runs the user's agent once per prompt, each in a
session of the session servers (`trainers.episode.run_episode`: SkyRL's
sampling pinned on it), at most ``max_concurrency`` at once, and returns
the sessions' exports as SkyRL's rows (`outputs`): one per prompt, or one
per turn under step-wise training.

The agent is the same function as verl's (`trainers.agent`): ``async def
solve(session, row) -> float``, its row SkyRL's prompt: ``prompt`` (the
chat messages; also ``raw_prompt``, verl's name for them, so one function
reads both trainers' rows), ``env_class``, the dataset's other columns
(SkyRL's ``env_extras``, flattened: ``reward_spec``, ``extra_info`` …),
``instance_id``, ``repetition_id``, ``global_step`` and ``training_phase``.
Its reward is the row's: SkyRL has no reward stage after the generator,
so an agent returning None cannot be trained on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
from skyrl.backends.skyrl_train.utils.routed_experts import compact_routed_expert_indices
from skyrl.train.generators.base import GeneratorInterface

from ...client import SessionClient
from ..episode import EpisodeFailed, run_episode
from ..weight_sync import WeightSync
from ..workers import WorkerSync
from .options import UNSET, Options, pinned_sampling, resolve_options, wants_logprobs
from .outputs import EpisodeRows, generator_output, placeholder_row, step_rows, trajectory_row
from .weight_sync import install_weight_sync, register

__all__ = ["SessionGenerator"]

logger = logging.getLogger("rollout_session.trainers")


class SessionGenerator(GeneratorInterface):  # type: ignore[misc]
    """Built by SkyRL's experiment (`experiment.SessionPPOExp`) from
    ``generator.rollout_session`` (`config`); each keyword argument, when
    given, replaces that option: ``servers``, ``agent``, ``workers``,
    ``api_key``, ``admin_api_key``, ``max_concurrency``, ``weight_sync``,
    ``on_error``, ``experts_top_k``, and SkyRL's own ``step_wise``
    (``generator.step_wise_trajectories``) and ``routed_experts``
    (``generator.inference_engine.enable_return_routed_experts``)."""

    def __init__(
        self,
        cfg: Any,
        tokenizer: Any,
        inference_engine_client: Any,
        *,
        servers: Sequence[str] | Any = UNSET,
        agent: Any = UNSET,
        workers: Any = UNSET,
        api_key: str | Any | None = UNSET,
        admin_api_key: str | Any | None = UNSET,
        max_concurrency: int | Any = UNSET,
        weight_sync: str | Any | None = UNSET,
        on_error: str | Any = UNSET,
        experts_top_k: int | Any | None = UNSET,
        step_wise: bool | Any = UNSET,
        routed_experts: bool | Any = UNSET,
    ) -> None:
        self.options: Options = resolve_options(
            cfg,
            {
                "servers": servers,
                "agent": agent,
                "workers": workers,
                "api_key": api_key,
                "admin_api_key": admin_api_key,
                "max_concurrency": max_concurrency,
                "weight_sync": weight_sync,
                "on_error": on_error,
                "experts_top_k": experts_top_k,
                "step_wise": step_wise,
                "routed_experts": routed_experts,
            },
        )
        self._cfg = cfg
        self._client = inference_engine_client
        # A placeholder row's one token: SkyRL pads with pad_token_id anyway.
        self._placeholder_id = _placeholder_token(tokenizer)
        self._sessions = SessionClient(self.options.servers, api_key=self.options.api_key)
        self._workers = WorkerSync(self._sessions, api_key=self.options.admin_api_key)
        self._unpinned_said: set[frozenset[str]] = set()
        if self.options.weight_sync is not None:
            install_weight_sync()
            sync = WeightSync(
                self.options.servers,
                mode=self.options.weight_sync,
                api_key=self.options.admin_api_key,
            )
            register(inference_engine_client, sync)

    async def generate(self, input_batch: Mapping[str, Any]) -> Any:
        prompts: Sequence[Any] = input_batch["prompts"]
        count = len(prompts)
        trajectory_ids = input_batch.get("trajectory_ids")
        if self.options.step_wise and trajectory_ids is None:
            # SkyRL's own generator asserts the same: step-wise rows are told
            # apart by their trajectory ids (validate_generator_output).
            raise ValueError("step-wise training needs the batch's trajectory_ids")
        params = input_batch.get("sampling_params")
        sampling = self._sampling(params)
        await self._register_workers()
        done: list[EpisodeRows | None] = [None] * count
        failures: list[BaseException] = []
        limiter = anyio.CapacityLimiter(self.options.max_concurrency)

        async def one(i: int) -> None:
            async with limiter:
                started = time.monotonic()
                row = _row(input_batch, i)
                try:
                    done[i] = await self._episode(row, sampling, started)
                except EpisodeFailed as failure:
                    if self.options.on_error == "raise":
                        failures.append(failure)
                        return
                    logger.warning("%s; its row trains nothing (on_error: mask)", failure)
                    done[i] = EpisodeRows(
                        [placeholder_row(self._placeholder_id)],
                        session_id=None,
                        seconds=time.monotonic() - started,
                        masked=str(failure),
                    )
                except Exception as error:  # the session servers, the conversion
                    failures.append(error)

        async with anyio.create_task_group() as group:
            for i in range(count):
                group.start_soon(one, i)
        if failures:
            if len(failures) > 1:
                logger.error("%d of %d episodes failed; the first:", len(failures), count)
            raise failures[0]
        episodes = [e for e in done if e is not None]
        return generator_output(
            episodes,
            trajectory_ids,
            step_wise=self.options.step_wise,
            logprobs=wants_logprobs(params, self._cfg),
            routes=self.options.experts_top_k is not None,
            compact=compact_routed_expert_indices,
        )

    async def aclose(self) -> None:
        """Close the connections to the session servers (SkyRL never asks:
        they go with its process)."""
        await self._sessions.aclose()

    async def _episode(
        self, row: dict[str, Any], sampling: dict[str, Any], started: float
    ) -> EpisodeRows:
        episode = await run_episode(
            self._sessions,
            self.options.agent,
            row,
            sampling=sampling,
            metadata={
                "trainer": "skyrl",
                "instance_id": row["instance_id"],
                "repetition_id": row["repetition_id"],
                "global_step": row["global_step"],
            },
        )
        top_k = self.options.experts_top_k
        rows = (
            step_rows(episode, top_k)
            if self.options.step_wise
            else [trajectory_row(episode, top_k)]
        )
        segments = episode.document["segments"]
        turns = [turn for segment in segments for turn in segment.get("turns") or ()]
        return EpisodeRows(
            rows,
            session_id=episode.session_id,
            seconds=time.monotonic() - started,
            segments=len(segments),
            turns=len(turns),
            continuations=sum(len(t.get("continuations") or ()) for t in turns),
        )

    def _sampling(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """SkyRL's sampling, pinned on every session; what cannot be pinned is
        said once per process and set of keys (the agent's own values apply
        to them)."""
        pinned, unpinned = pinned_sampling(params)
        keys = frozenset(unpinned)
        if keys and keys not in self._unpinned_said:
            self._unpinned_said.add(keys)
            logger.warning(
                "SkyRL's sampling parameters %s cannot be pinned on the sessions (the session "
                "servers pin %s): the agent's own values, if any, are sent for them",
                unpinned,
                sorted(pinned),
            )
        return pinned

    async def _register_workers(self) -> None:
        workers = self.options.workers
        if workers is None or not self._workers.due():
            return
        if workers == "skyrl":
            urls = getattr(self._client, "server_urls", None)
            if not urls:
                raise ValueError(
                    f"workers: skyrl needs SkyRL's inference client's server_urls; "
                    f"{type(self._client).__name__} has none: list the workers' URLs under "
                    "generator.rollout_session.workers, or null when the session servers have them"
                )
            await self._workers.sync(urls)
        else:
            await self._workers.sync(workers)


def _row(batch: Mapping[str, Any], i: int) -> dict[str, Any]:
    """Prompt `i` of SkyRL's batch as the agent's row."""
    extras = batch.get("env_extras")
    env_classes = batch.get("env_classes")
    ids = batch.get("trajectory_ids")
    meta = batch.get("batch_metadata")
    tid = ids[i] if ids is not None else None
    prompt = batch["prompts"][i]
    return {
        **(extras[i] if extras is not None and extras[i] else {}),
        "prompt": prompt,
        "raw_prompt": prompt,
        "env_class": env_classes[i] if env_classes is not None else None,
        "instance_id": getattr(tid, "instance_id", None),
        "repetition_id": getattr(tid, "repetition_id", None),
        "global_step": getattr(meta, "global_step", None),
        "training_phase": getattr(meta, "training_phase", None),
    }


def _placeholder_token(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0
