"""SGLang 0.5.23's ``POST /open_session`` and ``POST /close_session``.

Models ``srt/entrypoints/http_server.py`` ``open_session`` /
``close_session`` (``OpenSessionReqInput``, ``CloseSessionReqInput``) and
the scheduler's ``open_session`` / ``close_session``
(``srt/managers/scheduler.py``): the session controller (`sessions`) and,
with ``--enable-session-radix-cache``, the id's references in the prefix
cache. The table itself is the `Emulator`'s.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollout_session.emulator.faults import Reply
from rollout_session.emulator.sglang.replies import generate_error, validation_error
from rollout_session.emulator.worker import Emulator

__all__ = ["close_session", "open_session"]


def open_session(emulator: Emulator, raw: bytes) -> Reply:
    """``/open_session``: the new id as a JSON string, or SGLang's refusal."""
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    emulator.reap()
    if not isinstance(body, dict):
        return validation_error("body: Input should be a valid dictionary")
    capacity = body.get("capacity_of_str_len")
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        return validation_error("capacity_of_str_len: Field required (an integer)")
    sid, streaming, timeout = body.get("session_id"), body.get("streaming"), body.get("timeout")
    if sid is not None and not isinstance(sid, str):
        return validation_error("session_id: Input should be a valid string")
    if streaming is not None and not isinstance(streaming, bool):
        return validation_error("streaming: Input should be a valid boolean")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float | None):
        return validation_error("timeout: Input should be a valid number")
    if streaming and not emulator.config.enable_streaming_session:
        return generate_error(
            "Streaming sessions are disabled. Please relaunch with --enable-streaming-session."
        )
    opened = emulator.sessions.open(
        sid, capacity, bool(streaming), None if timeout is None else float(timeout), emulator.now()
    )
    if opened is None:
        return generate_error(
            "Failed to open the session. Check if a session with the same id is still open."
        )
    emulator.sessions_opened.append(opened)
    if emulator.cache.session_refs:
        emulator.cache.open_session(opened)  # Scheduler.open_session
    emulator.notify()
    return Reply(200, orjson.dumps(opened))


def close_session(emulator: Emulator, raw: bytes) -> Reply:
    """``/close_session``: 200 with an empty body, whether or not the id is open."""
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    sid = body.get("session_id") if isinstance(body, dict) else None
    if not isinstance(sid, str):
        return validation_error("session_id: Field required")
    emulator.reap()
    emulator.sessions_closed.append(sid)
    # Scheduler.close_session: with --enable-session-radix-cache the id's
    # references go (its blocks stay cached); without it an id that was
    # never opened is only a logged warning in SGLang.
    emulator.cache.release_session(sid)
    emulator.sessions.close(sid)
    emulator.sessions_changed()
    emulator.notify()
    return Reply(200, b"")
