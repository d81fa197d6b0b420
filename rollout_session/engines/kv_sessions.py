"""Worker-side KV sessions (`--kv-sessions`) and request priority
(docs/kv-sessions.md).

A session's turns already go to one worker, whose radix cache usually still
holds the history's KV. ``hint`` tells the worker which session a turn
belongs to, as SGLang's `session_id`: a worker launched with
`--enable-session-radix-cache` references that KV for the session, evicts
unreferenced KV before it, and drops the reference on `/close_session`
(sent when the session closes, expires or moves, and at shutdown).

``delta`` (engine ``sglang-generate`` only) sends each turn only the ids
the worker does not hold, over SGLang's non-streaming sessions
(``engines/sglang_generate/delta.py``). SGLang's chat route cannot: it
accepts ``session_params`` and ignores it (serving_chat builds the request
without it), so a worker would decode from the new ids alone.

``stream`` — SGLang's streaming sessions — is refused: they hold KV outside
the evictable cache, need ``--enable-streaming-session``, allow one request
in flight and plain appends only, and SGLang's maintainers advise against
them (docs/kv-sessions.md#streaming-sessions).
"""

from __future__ import annotations

import enum

__all__ = [
    "DELTA_NEEDS_GENERATE",
    "KV_MODES",
    "PRIORITY_RANGE",
    "STREAM_REFUSED",
    "KvMode",
    "is_priority",
]


class KvMode(enum.Enum):
    OFF = "off"  # full input_ids, nothing else
    HINT = "hint"  # full input_ids plus SGLang's session_id; /close_session at the end
    # sglang-generate only: SGLang sessions (session_params), each turn sends
    # the ids the worker does not hold; a lost session is rebuilt.
    DELTA = "delta"


KV_MODES = tuple(m.value for m in KvMode)

STREAM_REFUSED = (
    "kv_sessions 'stream' (SGLang's streaming sessions) is not offered: they hold KV outside "
    "the evictable cache, need --enable-streaming-session and take one request at a time; "
    "use 'delta' with --engine sglang-generate (docs/kv-sessions.md#streaming-sessions)"
)
DELTA_NEEDS_GENERATE = (
    "kv_sessions 'delta' needs --engine sglang-generate: SGLang's chat route ignores "
    "session_params, so a worker would decode from the new ids alone (docs/kv-sessions.md)"
)

# SGLang's own check of a request's `priority` (tokenizer_manager).
PRIORITY_RANGE = "priority must be a signed 64-bit integer"


def is_priority(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 63
