"""`serve` replays the journal before the listener opens.

The app's own start-up runs inside hypercorn's lifespan, which has a fixed
limit (60 s); a large journal used to be replayed there and never finish.
Replay now comes first, with no limit, and the listener opens on a server
that already holds every restored session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from rollout_session import Settings
from rollout_session.cli.run import serve
from rollout_session.http import serving
from rollout_session.http.app import server_context
from rollout_session.session.journal.writer import Journal
from tests.unit.session.journal.test_journal import do_turn, new_session


class Listening(Exception):
    """Stands for the listener opening (the test stops there)."""


async def test_serve_replays_the_journal_before_the_listener_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal, _ = await Journal.open(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        for i in range(3):
            journal.create(session := new_session(f"s{i}"))
            do_turn(journal, session, np.random.default_rng(i))
        await journal.wait_durable()
        await journal.aclose()
    seen: list[tuple[bool, list[str]]] = []

    async def start_server(nursery: trio.Nursery, app: Any, **options: Any) -> None:
        store = server_context(app).store
        seen.append((store.journal is not None, sorted(s.id for s in store.registry)))
        raise Listening

    monkeypatch.setattr(serving, "start_server", start_server)
    with pytest.raises(BaseExceptionGroup) as info:
        await serve(Settings(workers=("http://127.0.0.1:9",), journal=str(tmp_path)))
    assert info.group_contains(Listening)
    assert seen == [(True, ["s0", "s1", "s2"])]
    # A start that failed released the journal.
    again, restored = await Journal.open(tmp_path)
    await again.aclose()
    assert len(restored) == 3
