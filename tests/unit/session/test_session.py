"""The one-turn-in-flight gate and the registry, without HTTP."""

from __future__ import annotations

import orjson
import pytest

from rollout_session.errors import (
    InvalidRequest,
    SessionBusy,
    SessionClosing,
    SessionExists,
    SessionNotFound,
)
from rollout_session.session.segments import Branch, Divergence
from rollout_session.session.session import SessionRegistry, SessionState


def test_claim_release_and_busy() -> None:
    session = SessionRegistry().create("s")
    slot = session.claim(1.0)
    with pytest.raises(SessionBusy):
        session.claim(2.0)
    session.release(slot, 3.0)
    assert session.slot is None and slot.done.is_set() and session.last_active_at == 3.0
    session.claim(4.0)


def test_closing_beats_busy_and_cancels_the_turn() -> None:
    session = SessionRegistry().create("s")
    slot = session.claim(1.0)
    assert session.begin_close(2.0) is slot
    assert slot.cancel_scope.cancel_called
    with pytest.raises(SessionClosing):
        session.claim(2.0)


def test_expired_takes_no_turns() -> None:
    session = SessionRegistry().create("s")
    session.state = SessionState.EXPIRED
    with pytest.raises(SessionNotFound):
        session.claim(1.0)


def test_registry_ids() -> None:
    registry = SessionRegistry(clock=lambda: 7.0)
    generated = registry.create()
    assert len(generated.id) == 32 and generated.created_at == 7.0
    with pytest.raises(SessionExists):
        registry.create(generated.id)
    with pytest.raises(InvalidRequest):
        registry.create("no/slash")
    registry.remove(generated)
    with pytest.raises(SessionNotFound):
        registry.get(generated.id)


def test_paging_filters_by_state() -> None:
    registry = SessionRegistry()
    for i in range(5):
        registry.create(f"s{i}")
    registry.get("s2").state = SessionState.EXPIRED
    page, more = registry.page(state=SessionState.OPEN, limit=2, after="s0")
    assert [s.id for s in page] == ["s1", "s3"] and more
    with pytest.raises(InvalidRequest):
        registry.page(state=None, limit=2, after="zzz")


def test_paging_walks_every_session_once_after_removals_and_restores() -> None:
    """Creation order survives removals and journal restores, and a cursor
    is found without scanning the registry."""
    registry = SessionRegistry()
    sessions = [registry.create(f"s{i}") for i in range(7)]
    registry.remove(sessions[3])
    registry.restore(sessions[3])  # restored last, as replay re-adds it
    registry.remove(sessions[5])
    seen: list[str] = []
    after: str | None = None
    while True:
        page, more = registry.page(state=None, limit=2, after=after)
        seen += [s.id for s in page]
        if not more:
            break
        after = page[-1].id
    assert seen == ["s0", "s1", "s2", "s4", "s6", "s3"]
    assert [s.id for s in registry] == seen
    with pytest.raises(InvalidRequest):
        registry.page(state=None, limit=2, after="s5")  # removed: no longer a cursor


@pytest.mark.parametrize("how", ["close", "expire"], ids=["closing", "expired"])
def test_stopped_is_set_when_the_session_stops_taking_turns(how: str) -> None:
    session = SessionRegistry().create("s")
    stopped = session.stopped()
    assert not stopped.is_set() and session.stopped() is stopped and session.refusal() is None
    if how == "close":
        session.begin_close(1.0)
        assert isinstance(session.refusal(), SessionClosing)
    else:
        session.expire(1.0)
        assert isinstance(session.refusal(), SessionNotFound)
    assert stopped.is_set()
    assert session.stopped().is_set()  # a stopped session's is set at once


def test_stopped_after_a_failed_collection_is_a_new_event() -> None:
    """A collection the journal could not record puts the session back open:
    its next waiters wait again."""
    session = SessionRegistry().create("s")
    first = session.stopped()
    session.begin_close(1.0)
    session.state, session.closed_at = SessionState.OPEN, None
    assert first.is_set() and not session.stopped().is_set()


def test_stored_bytes_count_metadata_and_every_segment() -> None:
    session = SessionRegistry().create("s", metadata={"task": "x" * 1000})
    assert session.stored_bytes() == session.metadata_bytes == len('{"task":""}') + 1000
    session.messages = [{"role": "user", "content": "y" * 5000}]
    session.tools = [{"type": "function", "function": {"name": "f"}}]
    first = session.stored_bytes()
    assert first >= session.metadata_bytes + 5000 + len(orjson.dumps(session.tools))
    session.start_segment(Branch(Divergence.HISTORY_EDITED, 0, 0))
    sealed = session.earlier[-1]
    assert session.sealed_bytes == first - session.metadata_bytes
    assert session.stored_bytes() == first  # the new segment holds nothing yet
    session.messages = [{"role": "user", "content": "z" * 7000}]
    assert session.stored_bytes() > first + 7000
    session.reopen_segment(sealed)
    assert session.sealed_bytes == 0 and session.stored_bytes() == first
