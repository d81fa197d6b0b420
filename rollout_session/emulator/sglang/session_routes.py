"""SGLang 0.5.23's ``POST /open_session`` and ``POST /close_session``.

Models ``srt/entrypoints/http_server.py`` ``open_session`` /
``close_session`` (``OpenSessionReqInput``, ``CloseSessionReqInput``) and
the scheduler's ``open_session`` / ``close_session``
(``srt/managers/scheduler.py``): the session controller (`sessions`) and,
with ``--enable-session-radix-cache``, the id's references in the prefix
cache. The table itself is the `Emulator`'s.
"""

from __future__ import annotations

from typing import Final

import orjson

from rollout_session.emulator.faults import Reply
from rollout_session.emulator.sglang.io_struct import (
    CloseSessionReqInput,
    OpenSessionReqInput,
    read_struct,
)
from rollout_session.emulator.sglang.replies import Invalid, generate_error
from rollout_session.emulator.worker import Emulator

__all__ = ["close_session", "open_session"]

# Each struct's defaults (io_struct.py), BaseReq's first.
_BASE: Final = {"rid": None, "http_worker_ipc": None}
_OPEN_DEFAULTS: Final = {**_BASE, "session_id": None, "streaming": None, "timeout": None}


def open_session(emulator: Emulator, raw: bytes) -> Reply:
    """``/open_session``: the new id as a JSON string, or SGLang's refusal."""
    emulator.reap()
    try:
        body = read_struct(raw, OpenSessionReqInput, _OPEN_DEFAULTS)
    except Invalid as exc:
        return exc.reply()
    streaming, timeout = body["streaming"], body["timeout"]
    if streaming and not emulator.config.enable_streaming_session:
        return generate_error(
            "Streaming sessions are disabled. Please relaunch with --enable-streaming-session."
        )
    opened = emulator.sessions.open(
        body["session_id"], body["capacity_of_str_len"], bool(streaming), timeout, emulator.now()
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
        sid = read_struct(raw, CloseSessionReqInput, _BASE)["session_id"]
    except Invalid as exc:
        return exc.reply()
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
