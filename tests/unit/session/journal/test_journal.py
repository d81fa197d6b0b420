"""The durable journal: round trips, torn and corrupt tails, compaction, fsync
policies, durability ordering, and random event sequences against the
in-memory state (the model is the real `Session`/`Trajectory` objects)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_session.session.journal import format as fmt
from rollout_session.session.journal import reader
from rollout_session.session.journal.writer import Journal, JournalError
from rollout_session.session.segments import Branch, Divergence, Rollback, Segment
from rollout_session.session.session import Session, SessionState
from rollout_session.session.trajectory import Continuation, Turn
from rollout_session.tokens import VersionSpan
from tests import ROOT

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
NOW = 1_700_000_000.0


def new_session(sid: str, **metadata: Any) -> Session:
    return Session(
        id=sid, metadata=dict(metadata), created_at=NOW + 0.125, last_active_at=NOW, ttl_s=30.0
    )


def do_turn(
    journal: Journal,
    session: Session,
    rng: np.random.Generator,
    *,
    keep: int | None = None,
    prompt: int = 20,
    sampled: int = 30,
    width: int | None = None,
    tools: list[Any] | None = None,
    branch: Branch | None = None,
    rollback: Divergence | None = None,
) -> None:
    """What `commit_turn` does (new segment or rollback + append + message
    splice), then journal it."""
    if branch is not None:
        session.start_segment(branch)
    traj = session.trajectory
    keep = len(traj.turns) if keep is None else keep
    if rollback is not None:
        dropped = traj.turns[keep:]
        sampled = sum(t.completion_end - t.completion_start for t in dropped)
        session.rollbacks.append(
            Rollback(rollback, len(session.earlier), keep, len(dropped), sampled, keep, NOW + 1.5)
        )
    start = traj.length_after(keep)
    kept = traj.turns[keep - 1].messages_end if keep else 0
    request = [*session.messages[:kept], {"role": "user" if keep == 0 else "tool", "content": "ü"}]
    completion_start = start + prompt
    turn = Turn(
        index=keep,
        prompt_start=start,
        completion_start=completion_start,
        completion_end=completion_start + sampled,
        messages_end=len(request) + 1,
        finish_reason=str(rng.choice(["stop", "length", "tool_calls"])),
        worker="http://w1",
        weight_version=str(rng.integers(5)),
        cached_tokens=int(rng.integers(start + 1)),
        upstream_latency_s=float(rng.random()),
        created_at=NOW + float(rng.random()),
        **interrupted(rng, sampled, start + prompt),
    )
    logprobs = (-rng.exponential(2.0, sampled)).astype(np.float32)
    if sampled:
        # Bit patterns a text round trip would lose: -0.0 and a subnormal.
        logprobs[0] = np.float32(-0.0)
        logprobs[-1] = -np.float32(1e-45)
    experts = None
    if width is not None:
        positions = turn.completion_end - 1 - traj.expert_positions(keep)
        experts = (rng.integers(0, 256, positions * width, dtype=np.int32).tobytes(), width)
    traj.commit(
        keep_turns=keep,
        prompt_ids=rng.integers(0, 150_000, prompt).tolist(),
        sampled_ids=rng.integers(0, 150_000, sampled, dtype=np.int32),
        sampled_logprobs=logprobs,
        turn=turn,
        experts=experts[0] if experts else None,
        experts_width=experts[1] if experts else None,
    )
    answer = {"role": "assistant", "content": f"a{len(traj.turns)}", "tool_calls": []}
    session.messages = [*session.messages[:kept], *request[kept:], answer]
    if keep == 0:
        session.tools = tools
    # The kwargs the turn rendered with (the inspector's diff re-renders with them).
    session.template_kwargs = (
        {"enable_thinking": bool(rng.integers(2))} if rng.integers(2) else None
    )
    session.model = "m"
    session.worker = "http://w1"
    journal.turn(session, experts, new_segment=branch is not None, rolled_back=rollback is not None)


def interrupted(rng: np.random.Generator, sampled: int, prompt: int) -> dict[str, Any]:
    """Policy spans for `sampled` tokens: one, or two with a continuation
    between them (a weight update midway)."""
    if sampled < 2 or not rng.integers(2):
        return {"weight_versions": (VersionSpan(0, sampled, "v1"),) if sampled else ()}
    cut = int(rng.integers(1, sampled))
    return {
        "weight_versions": (VersionSpan(0, cut, "v1"), VersionSpan(cut, sampled, None)),
        "continuations": (Continuation(cut, "http://w2", prompt + cut, 3, int(rng.integers(2))),),
    }


def state(session: Session) -> dict[str, Any]:
    """What replay must restore; a session being closed comes back expired, unpinned."""
    life = (session.state, session.closed_at, session.model, session.worker)
    if session.state is SessionState.CLOSING:
        life = (SessionState.EXPIRED, session.closed_at, session.model, None)
    return {
        "fields": (session.id, session.metadata, session.created_at, session.ttl_s),
        "life": life,
        "rollbacks": list(session.rollbacks),
        "segments": [segment_state(s) for s in session.segments()],
    }


def segment_state(segment: Segment) -> dict[str, Any]:
    traj = segment.trajectory
    return {
        "branch": segment.branch,
        "tools": segment.tools,
        "template_kwargs": segment.template_kwargs,
        "messages": segment.conversation.messages(),
        "ids": traj.tokens.ids.tobytes(),
        "mask": traj.tokens.mask.tobytes(),
        "logprobs": traj.tokens.logprobs.tobytes(),  # bits, not values
        "turns": list(traj.turns),
        "experts": (bytes(traj.experts), traj.experts_width),
    }


def states(sessions: list[Session] | dict[str, Session]) -> dict[str, dict[str, Any]]:
    values = sessions.values() if isinstance(sessions, dict) else sessions
    return {s.id: state(s) for s in values}


@asynccontextmanager
async def running(path: Path, **options: Any) -> AsyncIterator[tuple[Journal, list[Session]]]:
    journal, restored = await Journal.open(path, now=NOW, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        yield journal, restored
        await journal.aclose()


async def replayed(path: Path, **options: Any) -> dict[str, dict[str, Any]]:
    journal, restored = await Journal.open(path, now=NOW, **options)
    await journal.aclose()
    assert all(s.last_active_at == NOW for s in restored)
    return states(restored)


def segment(path: Path) -> Path:
    (only,) = sorted(path.glob("journal-*.log"))
    return only


async def realistic(journal: Journal, rng: np.random.Generator) -> dict[str, Session]:
    """Tools, a first-turn retry, a rollback, routed experts, segments, an
    expiry, a collect."""
    a, b, c, d = (new_session(x, run={"step": 3}) for x in ("a", "b", "c", "d"))
    for s in (a, b, c, d):
        journal.create(s)
    do_turn(journal, a, rng, tools=TOOLS)
    do_turn(journal, a, rng, keep=0, tools=TOOLS)  # first-turn retry
    do_turn(journal, a, rng)
    do_turn(journal, a, rng, prompt=7, sampled=0)  # empty completion
    do_turn(journal, a, rng, keep=2, rollback=Divergence.RETRY)  # rollback of one turn
    for keep in (None, None, 1, None):
        do_turn(journal, b, rng, keep=keep, width=6)
    # Segments, each with its own tools, experts and a retry of its first turn.
    answer_dropped = Branch(Divergence.ANSWER_DROPPED, 0, 2)
    do_turn(journal, b, rng, keep=0, width=6, branch=answer_dropped, tools=None)
    do_turn(journal, b, rng, keep=0, width=6, rollback=Divergence.RETRY)
    do_turn(journal, b, rng, width=6)
    tools_changed = Branch(Divergence.TOOLS_CHANGED, 1, 0)
    do_turn(journal, b, rng, keep=0, width=6, branch=tools_changed, tools=TOOLS)
    do_turn(journal, c, rng)
    c.state, c.closed_at, c.worker = SessionState.EXPIRED, NOW + 9.5, None
    journal.expire(c)
    do_turn(journal, d, rng)
    journal.close(d.id)
    await journal.wait_durable()
    return {s.id: s for s in (a, b, c)}


@pytest.mark.parametrize("policy", ["always", "interval", "never"], ids=lambda p: f"fsync-{p}")
async def test_round_trip_of_realistic_sessions(tmp_path: Path, policy: str) -> None:
    rng = np.random.default_rng(1)
    async with running(tmp_path, fsync=policy) as (journal, restored):
        assert restored == []
        live = await realistic(journal, rng)
        expected = states(live)
    b = expected["b"]
    assert [s["experts"][1] for s in b["segments"]] == [6, 6, 6]
    assert [s["branch"] for s in b["segments"]][1:] == [
        Branch(Divergence.ANSWER_DROPPED, 0, 2),
        Branch(Divergence.TOOLS_CHANGED, 1, 0),
    ]
    assert expected["c"]["life"][0] is SessionState.EXPIRED
    assert await replayed(tmp_path) == expected
    # Restored sessions take more turns, appended to the same segment.
    async with running(tmp_path) as (journal, restored):
        assert states(restored) == expected
        by_id = {s.id: s for s in restored}
        do_turn(journal, by_id["a"], rng)
        do_turn(journal, by_id["b"], rng, width=6)
        expected = states(restored)
    assert await replayed(tmp_path) == expected


async def test_collected_sessions_vanish_and_ids_can_be_reused(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    async with running(tmp_path) as (journal, _):
        first = new_session("x")
        journal.create(first)
        do_turn(journal, first, rng)
        journal.close("x")
        again = new_session("x", second=True)
        journal.create(again)
        gone = new_session("y")
        journal.create(gone)
        journal.close("y")
    assert await replayed(tmp_path) == states([again])


async def two_sessions(path: Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    """A journal whose last record is a turn; (state before it, after it, its offset)."""
    rng = np.random.default_rng(3)
    async with running(path) as (journal, _):
        a, b = new_session("a"), new_session("b")
        journal.create(a)
        journal.create(b)
        do_turn(journal, a, rng)
        do_turn(journal, b, rng)
        await journal.wait_durable()
        before = states([a, b])
        last = segment(path).stat().st_size
        do_turn(journal, a, rng, prompt=5, sampled=12)
    return before, states([a, b]), last


async def test_torn_tail_at_every_byte_replays_what_came_before(tmp_path: Path) -> None:
    before, after, last = await two_sessions(tmp_path / "src")
    data = segment(tmp_path / "src").read_bytes()
    for cut in range(last, len(data)):
        where = tmp_path / f"cut{cut}"
        where.mkdir()
        (where / fmt.segment_name(1)).write_bytes(data[:cut])
        assert await replayed(where) == before, cut
        assert segment(where).stat().st_size == last  # truncated to the good part
    assert await replayed(tmp_path / "src") == after


@pytest.mark.parametrize("where", ["last", "middle"], ids=["last-record", "middle-record"])
async def test_corrupt_crc_is_truncated_and_kept_aside(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    before, after, _ = await two_sessions(tmp_path)
    path = segment(tmp_path)
    data = bytearray(path.read_bytes())
    records: list[reader.Record] = []
    reader.scan(bytes(data), records.append)
    target = records[-1] if where == "last" else records[3]  # begin, create, create, turn a
    data[target.offset + target.size - 1] ^= 0x40
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        got = await replayed(tmp_path)
    if where == "last":
        assert got == before
    else:
        # Reading resynchronises after the damaged record: b's later turn is
        # kept; a, whose record it was, is dropped (its next turn would build
        # on the gap), loudly and by name.
        assert got == {"b": after["b"]}
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("dropping session a" in m for m in errors), errors
    assert "crc mismatch" in caplog.text
    assert (tmp_path / f"{path.name}.bad-{target.offset}").exists()


async def test_record_that_does_not_apply_drops_only_its_session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before, _, _ = await two_sessions(tmp_path)
    fd = os.open(segment(tmp_path), os.O_WRONLY | os.O_APPEND)
    meta = {"t": "turn", "id": "a", "turn": {"index": 9}}
    fmt.write_records(fd, [fmt.encode(meta, [b"", b"", b""])], sync=True)
    os.close(fd)
    with caplog.at_level(logging.ERROR):
        assert await replayed(tmp_path) == {"b": before["b"]}
    assert "dropping session a" in caplog.text


async def test_foreign_file_and_second_process_are_refused(tmp_path: Path) -> None:
    journal, _ = await Journal.open(tmp_path)
    with pytest.raises(JournalError, match="in use"):
        await Journal.open(tmp_path)
    await journal.aclose()
    (tmp_path / fmt.segment_name(7)).write_bytes(b"not a journal at all")
    with pytest.raises(JournalError, match=r"(journal header|not a journal segment)"):
        await Journal.open(tmp_path)


@pytest.mark.parametrize("older", [True, False], ids=["older-segment", "only-segment"])
async def test_an_empty_newest_segment_is_set_aside_and_logged(
    tmp_path: Path, older: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash between creating a segment and writing its header leaves it
    empty: start-up sets it aside, says so, and replays the one before."""
    before: dict[str, dict[str, Any]] = {}
    if older:
        await two_sessions(tmp_path)
        before = await replayed(tmp_path)
        assert set(before) == {"a", "b"}
    empty = tmp_path / fmt.segment_name(2)
    empty.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="rollout_session.journal"):
        assert await replayed(tmp_path) == before
    assert not empty.exists() and (tmp_path / (empty.name + ".empty")).exists()
    assert f"{empty} is empty" in caplog.text
    # What is appended from now on replays too.
    async with running(tmp_path) as (journal, _):
        journal.create(new_session("c"))
        await journal.wait_durable()
    assert "c" in await replayed(tmp_path)


async def churn(
    journal: Journal, rng: np.random.Generator, n: int, prefix: str = "s"
) -> dict[str, Session]:
    live: dict[str, Session] = {}
    for i in range(n):
        s = new_session(f"{prefix}{i}")
        journal.create(s)
        for _ in range(3):
            do_turn(journal, s, rng, prompt=200, sampled=400, width=2 if i % 2 else None)
        if i % 4:
            journal.close(s.id)
        else:
            live[s.id] = s
    await journal.wait_durable()
    return live


async def test_compaction_shrinks_and_replays_identically(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    async with running(tmp_path, compact_min_dead_bytes=1 << 40) as (journal, _):
        live = await churn(journal, rng, 40)
        big = journal.stats().bytes
        old = segment(tmp_path).read_bytes()
        await journal.compact()
        stats = journal.stats()
        assert stats.compactions == 2 and stats.dead_bytes == 0  # 1 = the initial segment
        assert stats.bytes == segment(tmp_path).stat().st_size < big / 3
        assert segment(tmp_path).name == fmt.segment_name(2)
        do_turn(journal, live["s0"], rng)  # appends go to the new segment
        expected = states(live)
    assert await replayed(tmp_path) == expected
    # A crash after the new segment was installed but before the old one was
    # deleted: the newer segment wins, the stale one is removed.
    (tmp_path / fmt.segment_name(1)).write_bytes(old)
    assert await replayed(tmp_path) == expected
    assert segment(tmp_path).name == fmt.segment_name(2)
    # A crash before the rename: an unfinished .tmp is ignored and removed.
    (tmp_path / f"{fmt.segment_name(3)}.tmp").write_bytes(old[:1000])
    assert await replayed(tmp_path) == expected
    assert not (tmp_path / f"{fmt.segment_name(3)}.tmp").exists()


async def test_compaction_triggers_by_itself_and_at_startup(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    async with running(tmp_path, compact_min_dead_bytes=100_000) as (journal, _):
        live = await churn(journal, rng, 12)
        assert journal.stats().dead_bytes > 100_000  # due: the writer compacts next
    assert journal.stats().compactions >= 2
    expected = states(live)
    async with running(tmp_path, compact_min_dead_bytes=1 << 40) as (journal, _):
        expected |= states(await churn(journal, rng, 8, prefix="t"))  # closes 6 of 8
        stats = journal.stats()
    assert stats.dead_bytes > stats.bytes / 2
    # At startup, over half the bytes dead is enough (no minimum).
    journal, restored = await Journal.open(tmp_path, now=NOW)
    assert journal.stats().segment == stats.segment + 1 and journal.stats().dead_bytes == 0
    await journal.aclose()
    assert states(restored) == expected


async def test_compaction_races_with_new_events(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    async with running(tmp_path, max_batch_bytes=4096) as (journal, _):
        live = await churn(journal, rng, 16)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(journal.compact)
            await trio.lowlevel.checkpoint()
            for sid in list(live)[:2]:  # closed while being snapshotted, or before
                journal.close(sid)
                del live[sid]
                await trio.lowlevel.checkpoint()
            for s in list(live.values()):
                do_turn(journal, s, rng, keep=1)
                await trio.lowlevel.checkpoint()
            fresh = new_session("fresh")
            journal.create(fresh)
            live["fresh"] = fresh
            do_turn(journal, fresh, rng)
        await journal.wait_durable()
        expected = states(live)
    assert await replayed(tmp_path) == expected


def test_install_segment_closes_its_fd_when_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / fmt.segment_name(1)).write_bytes(b"old")
    tmp = tmp_path / "new.tmp"
    tmp.write_bytes(b"new")
    calls = []

    def fsync_dir(directory: Path) -> None:
        calls.append(directory)
        if len(calls) == 2:  # after the rename, while dropping older segments
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(fmt, "fsync_dir", fsync_dir)
    open_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Input/output"):
        fmt.install_segment(tmp_path, 2, tmp)
    assert set(os.listdir("/proc/self/fd")) == open_before
    assert (tmp_path / fmt.segment_name(2)).read_bytes() == b"new"


@pytest.mark.parametrize(
    ("policy", "at_answer", "later"),
    [("always", 1, 1), ("interval", 0, 1), ("never", 0, 0)],
    ids=["always", "interval", "never"],
)
async def test_fsync_policies(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, policy: str, at_answer: int, later: int
) -> None:
    # Jump only after 50 ms of real idleness: an fsync in a worker thread
    # finishes before the virtual clock moves on.
    autojump_clock.autojump_threshold = 0.05
    rng = np.random.default_rng(8)
    async with running(tmp_path, fsync=policy, fsync_interval_s=5) as (journal, _):
        s = new_session("s")
        journal.create(s)
        do_turn(journal, s, rng)
        await journal.wait_durable()
        assert journal.stats().fsyncs == at_answer  # always: one group commit for both
        await trio.sleep(4)
        assert journal.stats().fsyncs == at_answer
        await trio.sleep(2)  # past the interval
        assert journal.stats().fsyncs == later
        await trio.sleep(10)  # nothing new to sync
        assert journal.stats().fsyncs == later
    assert journal.stats().fsyncs == later + 1  # aclose fsyncs whatever the policy
    assert await replayed(tmp_path) == states([s])


async def test_wait_durable_returns_only_after_its_records_are_written(tmp_path: Path) -> None:
    async def client(journal: Journal, i: int) -> None:
        journal.create(new_session(f"c{i}"))
        assert journal.lag()[0] >= 1
        await journal.wait_durable()
        ids: set[Any] = set()
        reader.scan(segment(tmp_path).read_bytes(), lambda r: ids.add(r.meta.get("id")))
        assert f"c{i}" in ids

    async with running(tmp_path, fsync="always") as (journal, _):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(client, journal, i)
                if i % 7 == 0:
                    await trio.lowlevel.checkpoint()
        assert journal.lag() == (0, 0.0)
        assert journal.stats().fsyncs < 51  # group commit: fewer fsyncs than records


async def test_a_writer_bug_is_fatal_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a disk error (those are recovered from, tests/unit/session/journal/test_failures.py):
    raised, and the journal takes nothing more."""
    journal, _ = await Journal.open(tmp_path)

    def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr("rollout_session.session.journal.writer.write_records", broken)
    journal.create(new_session("s"))
    with pytest.raises(ExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
    assert info.group_contains(RuntimeError, match="a bug")
    assert not journal.writable
    with pytest.raises(JournalError):
        await journal.wait_durable()
    with pytest.raises(JournalError):
        journal.create(new_session("t"))


def killed_child(path: str) -> None:
    """Run in a subprocess: acknowledge sessions once durable, until killed."""

    async def main() -> None:
        journal, _ = await Journal.open(path, fsync="never")
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            for i in range(10**6):
                s = new_session(f"k{i}")
                journal.create(s)
                do_turn(journal, s, np.random.default_rng(i), sampled=2000)
                do_turn(journal, s, np.random.default_rng(i))
                await journal.wait_durable()
                print(i, flush=True)

    trio.run(main)


async def test_kill_9_after_wait_durable_loses_nothing(tmp_path: Path) -> None:
    code = (
        "from tests.unit.session.journal.test_journal import killed_child; "
        f"killed_child({str(tmp_path)!r})"
    )
    root = ROOT
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=root
    )
    assert proc.stdout is not None
    out = b""
    while out.count(b"\n") < 30:
        chunk = await proc.stdout.receive_some()
        assert chunk, "the child died"
        out += chunk
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    await proc.stdout.aclose()
    acked = int(out.split(b"\n")[-2])
    journal, sessions = await Journal.open(tmp_path)
    await journal.aclose()
    restored = {s.id: s for s in sessions}
    for i in range(acked + 1):
        assert len(restored[f"k{i}"].trajectory.turns) == 2  # every acknowledged turn
    assert set(restored) <= {f"k{i}" for i in range(acked + 2)}  # + the one in flight


# --- random event sequences ---

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "create",
                "turn",
                "rollback",
                "expire",
                "closing",
                "collect",
                "close",
                "compact",
                "restart",
            ]
        ),
        st.integers(0, 5),  # which session
        st.integers(0, 40),  # tokens
    ),
    max_size=40,
)


async def run_ops(path: Path, ops: list[tuple[str, int, int]]) -> None:
    rng = np.random.default_rng(len(ops))
    journal, _ = await Journal.open(path, now=NOW, max_batch_bytes=2048)
    live: dict[str, Session] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        for op, k, n in ops:
            sid = f"s{k}"
            s = live.get(sid)
            if op == "create" and s is None:
                live[sid] = new_session(sid, k=k)
                journal.create(live[sid])
            elif op in ("turn", "rollback") and s and s.state is SessionState.OPEN:
                keep = min(len(s.trajectory.turns), n % 3) if op == "rollback" else None
                do_turn(
                    journal, s, rng, keep=keep, prompt=n + 1, sampled=n // 2, width=k % 2 or None
                )
            elif op == "expire" and s and s.state is SessionState.OPEN:
                s.state, s.closed_at = SessionState.EXPIRED, NOW + n
                journal.expire(s)
            elif op == "closing" and s and s.state is SessionState.OPEN:
                s.begin_close(NOW + n)  # a DELETE under way
                journal.closing(s)
            elif op == "collect" and s and s.state is not SessionState.COLLECTED:
                s.state, s.closed_at, s.worker = SessionState.COLLECTED, NOW + n, None
                journal.collect(s)  # readable until its close
            elif op == "close" and s:
                journal.close(sid)
                del live[sid]
            elif op == "compact":
                nursery.start_soon(journal.compact)  # races with the next events
            elif op == "restart":
                await journal.aclose()
                journal, restored = await Journal.open(path, now=NOW, max_batch_bytes=2048)
                assert states(restored) == states(live)
                live = {r.id: r for r in restored}
                await nursery.start(journal.run)
            await trio.lowlevel.checkpoint()
        await journal.wait_durable()
        await journal.aclose()
    assert await replayed(path) == states(live)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_random_event_sequences_replay_to_the_in_memory_state(
    ops: list[tuple[str, int, int]],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(run_ops, Path(tmp), ops)
        shutil.rmtree(tmp, ignore_errors=True)


async def test_segments_survive_compaction_and_count_no_dead_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    async with running(tmp_path, compact_min_dead_bytes=1 << 40) as (journal, _):
        s = new_session("s")
        journal.create(s)
        do_turn(journal, s, rng)
        do_turn(journal, s, rng)
        await journal.wait_durable()
        dead = journal.stats().dead_bytes
        # A new segment keeps the earlier one whole: nothing of it is dead.
        do_turn(journal, s, rng, keep=0, branch=Branch(Divergence.HISTORY_EDITED, 0, 1))
        await journal.wait_durable()
        assert journal.stats().dead_bytes == dead
        # A retry of the new segment's first turn supersedes only that turn.
        do_turn(journal, s, rng, keep=0, rollback=Divergence.RETRY)
        await journal.wait_durable()
        assert journal.stats().dead_bytes > dead
        await journal.compact()  # one snapshot with both segments
        do_turn(journal, s, rng)
        expected = states([s])
    assert len(expected["s"]["segments"]) == 2
    assert await replayed(tmp_path) == expected
