"""verl's weight update, with the session servers paused around it
(docs/trainers.md#verl-weight-sync).

verl 0.9.1 updates its rollout servers in ``CheckpointEngineManager.
update_weights(global_steps)`` (``verl/checkpoint_engine/base.py``), which
every trainer mode calls: it aborts the servers' requests (``abort_replicas``),
loads the new weights, and resumes them. Wrapped here, each update first
pauses the session servers (`trainers.weight_sync.WeightSync`: ``abort`` by
default, the turns at workers continued after the update; ``drain``) and
resumes them naming ``global_steps``, so the export's per-token versions are
verl's steps.

Two ways to install it, in the process that runs verl's trainer:

- ``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=
  rollout_session.trainers.verl.weight_sync``: verl imports the module
  when it builds the manager (``import_external_libs``), which installs the
  wrapper; the session servers are those the agent loops run on, which
  each loop publishes in the Ray cluster's key-value store
  (`publish_servers`) — an update before any loop ran pauses nothing;
- `install_weight_sync(servers)`, from a driver of one's own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence
from typing import Any, Literal

import orjson

from ..weight_sync import WeightSync

__all__ = ["install_weight_sync", "publish_servers"]

logger = logging.getLogger("rollout_session.trainers")

# The Ray key-value entry the agent loops publish their session servers in.
_KV_KEY = b"rollout_session/verl/weight_sync"

Mode = Literal["abort", "drain"]


def publish_servers(servers: Sequence[str], mode: Mode | None, api_key: str | None) -> None:
    """Tell the trainer's process which session servers to pause (the agent
    loops run elsewhere: verl's agent-loop workers); `mode` None: none."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():  # no Ray here: nobody to tell
        return
    value = orjson.dumps({"servers": list(servers), "mode": mode, "api_key": api_key})
    internal_kv._internal_kv_put(_KV_KEY, value, overwrite=True)


def _published() -> WeightSync | None:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(_KV_KEY)
    if not raw:
        return None
    entry = orjson.loads(raw)
    if entry["mode"] is None:
        return None
    return WeightSync(entry["servers"], mode=entry["mode"], api_key=entry["api_key"])


def install_weight_sync(
    servers: Sequence[str] | None = None, *, mode: Mode = "abort", api_key: str | None = None
) -> None:
    """Wrap verl's ``CheckpointEngineManager.update_weights`` (once) so that
    every weight update pauses `servers` (None: those the agent loops
    published) and resumes them at the update's ``global_steps``.
    `api_key`: the session servers' operator key."""
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.utils.ray_utils import auto_await

    fixed = None if servers is None else WeightSync(servers, mode=mode, api_key=api_key)
    current = CheckpointEngineManager.update_weights
    inner = getattr(current, "_rollout_session_inner", None) or current.__wrapped__

    @auto_await  # type: ignore[untyped-decorator]
    @functools.wraps(inner)
    async def update_weights(self: Any, global_steps: int | None = None) -> Any:
        sync = fixed or _published()
        if sync is None:
            return await inner(self, global_steps)
        return await sync.around(global_steps, lambda: inner(self, global_steps))

    update_weights._rollout_session_inner = inner
    CheckpointEngineManager.update_weights = update_weights
    logger.info("verl's weight updates pause the session servers (%s)", mode)


def _installed_on_import() -> None:
    """``custom_backend_module``: importing this module installs the wrapper
    (imported without verl, by the docs or a test, there is nothing to wrap)."""
    with contextlib.suppress(ImportError):
        install_weight_sync()


_installed_on_import()
