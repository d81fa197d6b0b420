"""The session servers paused around a trainer's weight update
(docs/trainers.md: each trainer's weight sync).

A trainer that updates its workers' weights while episodes run pauses the
session servers first (``abort``: the turns at workers are interrupted, and
continued after the resume under the new policy; ``drain``: the pause waits
for them), and resumes them naming the new policy: its step, as a decimal
string, which the export's per-token versions then carry and the adapters
read back as steps (`segments.version_step`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar

import anyio

from ..client import SessionClient

__all__ = ["WeightSync"]

logger = logging.getLogger("rollout_session.trainers")

T = TypeVar("T")


class WeightSync:
    def __init__(
        self,
        servers: Sequence[str],
        *,
        mode: Literal["abort", "drain"] = "abort",
        api_key: str | None = None,
    ) -> None:
        self.servers = tuple(servers)
        self.mode: Literal["abort", "drain"] = mode
        self._api_key = api_key

    async def around(
        self, step: int | Callable[[], int | None] | None, update: Callable[[], Awaitable[T]]
    ) -> T:
        """`update()` with the session servers paused; resumed naming `step`
        (a failed update resumes them without a new name: the workers still
        run what they ran). `step` may be a function, asked once `update()`
        has returned: a trainer that counts its weight syncs (SkyRL's
        ``weight_version``) advances the count inside the update."""
        async with SessionClient(self.servers) as client:
            await client.pause(self.mode, api_key=self._api_key)
            version: str | None = None
            try:
                result = await update()
                new_step = step() if callable(step) else step
                version = None if new_step is None else str(new_step)
            finally:
                with anyio.CancelScope(shield=True):
                    await client.resume(version, api_key=self._api_key)
                logger.info("session servers resumed%s", f" at step {version}" if version else "")
        return result
