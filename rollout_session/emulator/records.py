"""What the emulator keeps of each request it received, for tests to inspect.

Owns `ChatRecord` (one request as it arrived, before any check) and
`RecordLog` (the last ``record_limit`` of them). Engine-neutral: every
route of either engine records here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, overload

__all__ = ["ChatRecord", "RecordLog"]


@dataclass(frozen=True)
class ChatRecord:
    """One chat or generate request as received: parsed JSON body (None if unparsable)."""

    body: Any
    arrival: float  # trio.current_time()
    fault: str | None
    session_id: str | None
    # "chat" (/v1/chat/completions), "generate" (/generate),
    # "vllm-generate" (vLLM's /inference/v1/generate; session_id: X-Session-ID)
    # "vllm-render" (vLLM's /v1/chat/completions/render; the same) or
    # "vllm-derender" (its /v1/chat/completions/derender; the same).
    route: str = "chat"
    body_bytes: int = 0  # length of the raw request body
    # Its headers, names lowercased (what a proxy in front passed on).
    headers: Mapping[str, str] = field(default_factory=dict)


class RecordLog(deque[ChatRecord]):
    """The recorded requests, oldest dropped first; a slice is a list."""

    @overload
    def __getitem__(self, index: SupportsIndex) -> ChatRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[ChatRecord]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> ChatRecord | list[ChatRecord]:
        if isinstance(index, slice):
            return list(self)[index]
        return super().__getitem__(index)
