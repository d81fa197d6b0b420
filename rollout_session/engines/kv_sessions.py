"""Worker-side KV sessions (`--kv-sessions`) and request priority
(docs/kv-sessions.md).

A session's turns already go to one worker, whose radix cache usually still
holds the history's KV. ``hint`` tells the worker which session a turn
belongs to, as SGLang's `session_id`: a worker launched with
`--enable-session-radix-cache` references that KV for the session, evicts
unreferenced KV before it, and drops the reference on `/close_session`
(sent when the session closes, expires or moves, and at shutdown).

``stream`` — SGLang's streaming sessions, where a turn would send only the
ids the worker does not hold — is refused: SGLang 0.5.23 honours
`session_params` only on its native `/generate` route; its chat route
accepts the field and ignores it, so a worker would decode from the new ids
alone (docs/kv-sessions.md#delta-sync-stream).
"""

from __future__ import annotations

import enum

__all__ = ["KV_MODES", "PRIORITY_RANGE", "STREAM_REFUSED", "KvMode", "is_priority"]


class KvMode(enum.Enum):
    OFF = "off"  # full input_ids, nothing else
    HINT = "hint"  # full input_ids plus SGLang's session_id; /close_session at the end


KV_MODES = tuple(m.value for m in KvMode)

STREAM_REFUSED = (
    "kv_sessions 'stream' is not available: SGLang's chat completions route ignores "
    "session_params (it appends to a streaming session only on /generate), so a worker "
    "would decode from the new ids alone; use 'hint' (docs/kv-sessions.md#delta-sync-stream)"
)

# SGLang's own check of a request's `priority` (tokenizer_manager).
PRIORITY_RANGE = "priority must be a signed 64-bit integer"


def is_priority(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63
