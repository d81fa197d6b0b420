"""SkyRL's weight sync, with the session servers paused around it
(docs/trainers.md#skyrl-weight-sync).

SkyRL 0.4.0 syncs its inference servers' weights in one call,
``save_weights_for_sampler()`` of its dispatch: ``WorkerDispatch``
(``skyrl/backends/skyrl_train/workers/worker_dispatch.py``), or in the
simulated trainer ``_SimDispatch`` (``skyrl/train/fully_async_trainer_sim.py``).
Both trainers call it before training and after every step
(``skyrl/train/trainer.py`` and ``fully_async_trainer.py``: ``await
self.dispatch.save_weights_for_sampler()``); inside, where generation may
overlap the sync, it pauses its inference client (``pause_generation``:
vLLM's ``/pause`` in ``keep`` mode) and resumes it, and last of all counts
the sync (``increment_weight_version``: the client's ``weight_version``,
"the policy version", ``remote_inference_client.py``).

Wrapped here (`install_weight_sync`), each sync first pauses the session
servers of the generator built on that inference client
(`trainers.weight_sync.WeightSync`: ``abort`` by default: the session
servers interrupt their turns at the workers before SkyRL freezes them, and
continue them after, under the new weights; ``drain``), and resumes them
naming the client's ``weight_version`` after the sync: the export's
per-token versions are SkyRL's policy versions.

Why ``weight_version`` and not ``global_step``: it is what SkyRL itself
calls the policy version and salts vLLM's prefix cache with
(``generators/utils.py`` ``build_vllm_cache_salt``), it is known exactly
where the sync happens (the dispatch knows no step), and in a run started
afresh it equals the ``global_step`` whose batch is generated with those
weights (the sync before training makes it 1 for step 1, each step's sync
adds one). It is the client's count, not the checkpoint's: a run resumed
from a checkpoint counts from 1 again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

from ..weight_sync import WeightSync

__all__ = ["install_weight_sync", "register", "registered"]

logger = logging.getLogger("rollout_session.trainers")

# The generator's WeightSync per inference client: the dispatch holds the
# very client the experiment gave the generator (``RayPPOTrainer.build_models``
# builds the ``WorkerDispatch`` with the trainer's ``inference_engine_client``).
# By id: SkyRL's client is a dataclass, unhashable; the weak reference
# tells a reused id from the client it was registered for.
_SYNCS: dict[int, tuple[weakref.ref[Any], WeightSync]] = {}


def register(client: Any, sync: WeightSync | None) -> None:
    """SkyRL's weight syncs through `client` pause `sync`'s session servers
    (None: no longer)."""
    _SYNCS.pop(id(client), None)
    if sync is not None:
        key = id(client)
        _SYNCS[key] = (weakref.ref(client, lambda _: _SYNCS.pop(key, None)), sync)


def registered(client: Any) -> WeightSync | None:
    entry = _SYNCS.get(id(client))
    if entry is None or entry[0]() is not client:
        return None
    return entry[1]


def install_weight_sync() -> None:
    """Wrap SkyRL's ``save_weights_for_sampler`` (once per class) so that a
    sync through a registered client pauses its session servers."""
    from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch

    _wrap(WorkerDispatch, lambda dispatch: dispatch._inference_engine_client)
    # The simulated trainer's dispatch (fully_async.simulate_training): the
    # same pause, resume and count, no weights.
    with contextlib.suppress(ImportError, AttributeError):
        from skyrl.train.fully_async_trainer_sim import _SimDispatch

        _wrap(_SimDispatch, lambda dispatch: dispatch._client)


def _wrap(cls: Any, client_of: Callable[[Any], Any]) -> None:
    current = cls.save_weights_for_sampler
    if getattr(current, "_rollout_session_inner", None) is not None:
        return
    inner = current

    @functools.wraps(inner)
    async def save_weights_for_sampler(self: Any, *args: Any, **kwargs: Any) -> Any:
        client = client_of(self)
        sync = registered(client)
        if sync is None:
            return await inner(self, *args, **kwargs)
        return await sync.around(
            lambda: _weight_version(client), lambda: inner(self, *args, **kwargs)
        )

    save_weights_for_sampler._rollout_session_inner = inner  # type: ignore[attr-defined]
    cls.save_weights_for_sampler = save_weights_for_sampler
    logger.info("SkyRL's %s.save_weights_for_sampler pauses the session servers", cls.__name__)


def _weight_version(client: Any) -> int | None:
    version = getattr(client, "weight_version", None)
    if not isinstance(version, int):
        logger.warning(
            "SkyRL's inference client %s has no weight_version: the session servers resume "
            "without naming the new policy",
            type(client).__name__,
        )
        return None
    return version
