"""A fleet of 3 shards started by `serve --demo --processes 3` (docs/deploy.md#a-fleet).

One fleet per module (processes are slow to start); the tests run in file
order and the last one kills a shard.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import trio

from rollout_session import Settings, create_app
from rollout_session.client import SessionClient, rendezvous_owner
from rollout_session.emulator import EmulatorConfig, TextModel
from rollout_session.export import bulk as bulk_export
from rollout_session.fleet.processes import bind_sockets, fleet_urls
from rollout_session.http.serving import RunningServer, start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import agent_turn, spawn_worker
from tests.integration.raw_http import RawConnection
from tests.loopback import TLS
from tests.processes import start_listening

_READY = re.compile(r"^rollout-session fleet of 3 shards: (.+)$")
_PID = re.compile(r"^\[shard (\d)\] pid (\d+) for ")


@dataclass
class FleetProcess:
    process: subprocess.Popen[str]
    urls: list[str]
    pids: dict[int, int]
    journal: Path
    stderr: list[str] = field(default_factory=list)
    _said: threading.Condition = field(default_factory=threading.Condition)

    def read_stderr(self) -> None:
        assert self.process.stderr is not None
        with self.process.stderr:
            for line in self.process.stderr:
                with self._said:
                    self.stderr.append(line)
                    self._said.notify_all()

    def wait_for(self, text: str) -> str:
        """The first stderr line containing `text`, once the parent said it."""
        with self._said:
            found = self._said.wait_for(
                lambda: next((line for line in self.stderr if text in line), None), timeout=30
            )
        assert found is not None, "".join(self.stderr)
        return found


def _read_until_ready(process: subprocess.Popen[str], pids: dict[int, int]) -> list[str]:
    assert process.stdout is not None
    for line in process.stdout:
        if match := _PID.match(line):
            pids[int(match[1])] = int(match[2])
        if match := _READY.match(line.strip()):
            return match[1].split()
    raise RuntimeError("the fleet exited before it was ready")


def _drain(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    with process.stdout:
        for _ in process.stdout:
            pass


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetProcess]:
    tmp = tmp_path_factory.mktemp("fleet")
    command = [sys.executable, "-m", "rollout_session", "serve", "--demo", "--processes", "3",
               "--port", "0", "--journal", str(tmp / "journal"), "--journal-fsync", "never",
               "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    pids: dict[int, int] = {}
    running = FleetProcess(process, [], pids, tmp / "journal")
    threading.Thread(target=running.read_stderr, daemon=True).start()
    try:
        running.urls = _read_until_ready(process, pids)
        threading.Thread(target=_drain, args=(process,), daemon=True).start()
        yield running
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def test_create_through_any_shard_agents_on_owner_collect_through_any(
    fleet: FleetProcess,
) -> None:
    urls = fleet.urls
    async with httpx.AsyncClient(timeout=30, verify=TLS) as http:
        created = []
        for i in range(6):
            answer = await http.post(f"{urls[i % 3]}/sessions", json={"metadata": {"i": i}})
            assert answer.status_code == 201, answer.text
            created.append(answer.json())
        for doc in created:
            owner = rendezvous_owner(urls, doc["session_id"])
            assert doc["base_url"] == f"{owner}/sessions/{doc['session_id']}/v1"
            assert await trio.to_thread.run_sync(agent_turn, doc["base_url"])
        # Collection through a shard that does not own the session: 307.
        for doc in created:
            session_id = doc["session_id"]
            owner = rendezvous_owner(urls, session_id)
            other = next(u for u in urls if u != owner)
            path = f"/sessions/{session_id}/trajectory?format=document&schema=1"
            moved = await http.get(other + path)
            assert moved.status_code == 307
            assert moved.headers["location"] == owner + path
            followed = await http.get(other + path, follow_redirects=True)
            assert followed.status_code == 200 and len(followed.json()["turns"]) == 1
    # The trainer's client goes to the owner directly and collects.
    async with SessionClient(urls) as client:
        closed = await client.close(created[0]["session_id"])
        assert closed["status"] == "closed" and closed["metadata"] == {"i": 0}
        handle = await client.create()
        assert handle.server == rendezvous_owner(urls, handle.session_id)
        assert await trio.to_thread.run_sync(agent_turn, handle.base_url)


async def test_fleet_wide_health_sessions_workers_metrics(fleet: FleetProcess) -> None:
    urls = fleet.urls
    async with httpx.AsyncClient(timeout=30, verify=TLS) as http:
        ids = [(await http.post(f"{urls[0]}/sessions")).json()["session_id"] for _ in range(5)]
        health = (await http.get(f"{urls[2]}/health?fleet=1")).json()
        assert health["status"] == "ok"
        assert [s["url"] for s in health["shards"]] == urls
        per_shard = [(await http.get(f"{u}/health")).json()["sessions"] for u in urls]
        assert health["sessions"] == sum(per_shard) >= 5
        # Page through every shard's sessions, two at a time.
        listed: list[str] = []
        after = None
        while True:
            params = {"fleet": "1", "limit": "2", **({"after": after} if after else {})}
            page = (await http.get(f"{urls[1]}/sessions", params=params)).json()
            listed += [s["session_id"] for s in page["sessions"]]
            if not page["has_more"]:
                break
            after = listed[-1]
        assert len(listed) == len(set(listed)) == health["sessions"]
        assert set(ids) <= set(listed)
        workers = (await http.get(f"{urls[0]}/workers?fleet=1")).json()
        assert [len(s["workers"]) for s in workers["shards"]] == [1, 1, 1]
        metrics = (await http.get(f"{urls[0]}/metrics?fleet=1")).text
        for url in urls:
            assert f'rollout_sessions{{shard="{url}",state="open"}}' in metrics
        assert metrics.count("# TYPE rollout_sessions gauge") == 1


async def test_worker_changes_apply_to_every_shard(fleet: FleetProcess) -> None:
    urls = fleet.urls
    worker = "http://127.0.0.1:9"  # never admitted: stays joining
    async with httpx.AsyncClient(timeout=30, verify=TLS) as http:
        added = await http.post(f"{urls[1]}/workers", json={"url": worker})
        assert added.status_code == 201, added.text
        assert [s["status"] for s in added.json()["fleet"]] == [201, 201, 201]
        for url in urls:
            listed = (await http.get(f"{url}/workers")).json()["workers"]
            assert worker in [w["url"] for w in listed]
        removed = await http.delete(f"{urls[2]}/workers", params={"url": worker})
        assert removed.status_code == 200, removed.text
        for url in urls:
            listed = (await http.get(f"{url}/workers")).json()["workers"]
            assert worker not in [w["url"] for w in listed]
        # ?fleet=0: this shard only.
        one = await http.post(f"{urls[0]}/workers?fleet=0", json={"url": worker})
        assert one.status_code == 201 and "fleet" not in one.json()
        assert worker not in [
            w["url"] for w in (await http.get(f"{urls[1]}/workers")).json()["workers"]
        ]
        await http.delete(f"{urls[0]}/workers", params={"url": worker, "fleet": "0"})


async def test_a_killed_shard_fails_clearly_and_restarts_from_its_journal(
    fleet: FleetProcess,
) -> None:
    urls = fleet.urls
    victim = urls[1]
    async with httpx.AsyncClient(timeout=30, verify=TLS) as http:
        sessions: dict[str, list[str]] = {url: [] for url in urls}
        i = 0
        while min(len(v) for v in sessions.values()) < 2:
            session_id = f"kill-{i}"
            i += 1
            owner = rendezvous_owner(urls, session_id)
            if len(sessions[owner]) < 2:
                created = (
                    await http.post(f"{urls[0]}/sessions", json={"session_id": session_id})
                ).json()
                await trio.to_thread.run_sync(agent_turn, created["base_url"])
                sessions[owner].append(session_id)
        os.kill(fleet.pids[1], signal.SIGKILL)
        said = await trio.to_thread.run_sync(fleet.wait_for, f"shard 1 ({victim}")
        # Its sessions: connection refused, on their URL or through a redirect.
        for session_id in sessions[victim]:
            with pytest.raises(openai.APIConnectionError):
                await trio.to_thread.run_sync(agent_turn, f"{victim}/sessions/{session_id}/v1")
            with pytest.raises(httpx.ConnectError):
                await http.get(f"{urls[0]}/sessions/{session_id}", follow_redirects=True)
        async with SessionClient(urls, retries=0) as client:
            with pytest.raises(httpx.ConnectError):
                await client.trajectory(sessions[victim][0])
            # The other shards' sessions go on.
            for url in (urls[0], urls[2]):
                for session_id in sessions[url]:
                    doc = await client.trajectory(session_id, schema=1)
                    assert len(doc["turns"]) == 1
        unreachable = (await http.get(f"{urls[0]}/health?fleet=1")).json()
        assert unreachable["status"] == "degraded"
        assert unreachable["shards"][1]["status"] == "unreachable"
        # Bulk export refuses rather than leave the victim's sessions out.
        out = fleet.journal.parent / "export"
        with pytest.raises(SystemExit, match=f"fleet shards not answering: {re.escape(victim)} "):
            await trio.to_thread.run_sync(
                lambda: bulk_export.export_sessions(urls[0], out, progress=False)
            )
        assert not (out / "trajectories.jsonl").exists()
        # Started again as the parent said, it restores its sessions from its journal.
        restart = said.split("To start it again: ", 1)[1].split()
        assert f"--journal={fleet.journal / 'shard-1'}" in "=".join(restart)
        async with trio.open_nursery() as nursery:
            url, restarted = await start_listening(nursery, restart)
            assert url == victim
            for session_id in sessions[victim]:
                path = f"/sessions/{session_id}/trajectory?schema=1"
                doc = (await http.get(urls[2] + path, follow_redirects=True)).json()
                assert len(doc["turns"]) == 1
            restarted.send_signal(signal.SIGTERM)


InProcessFleet = Callable[..., Awaitable[tuple[str, ...]]]


@pytest.fixture
async def in_process_fleet(
    nursery: trio.Nursery, text_model: TextModel, chat_tokenizers: dict[str, ChatTokenizer]
) -> AsyncIterator[InProcessFleet]:
    """Start `shards` shards in this process over one emulator worker; shard
    i's fleet lists `extra[i]` too, if given. Stopped gracefully after."""
    servers: list[RunningServer] = []

    async def start(
        shards: int, *, extra: dict[int, tuple[str, ...]] | None = None, **settings: Any
    ) -> tuple[str, ...]:
        template = chat_tokenizers["chatml"]
        worker = await spawn_worker(
            nursery, text_model, EmulatorConfig(seed=0, chat_template=template.chat_template)
        )
        sockets = bind_sockets("127.0.0.1", 0, shards)
        urls = fleet_urls("127.0.0.1", sockets)
        for i, sock in enumerate(sockets):
            fleet = (*urls, *(extra or {}).get(i, ()))
            own = Settings(workers=(worker.url,), fleet=fleet, shard=i, **settings)
            app = create_app(own, tokenizer=template, worker_tls=TLS)
            servers.append(await start_server(nursery, app, bind=[f"fd://{sock.detach()}"]))
        return urls

    yield start
    for server in servers:
        await server.aclose()


async def test_a_null_id_is_drawn_for_the_fleet(
    in_process_fleet: InProcessFleet,
) -> None:
    urls = await in_process_fleet(2)
    async with httpx.AsyncClient(timeout=30, verify=TLS) as http:
        for _ in range(6):
            created = (await http.post(f"{urls[0]}/sessions", json={"session_id": None})).json()
            owner = rendezvous_owner(urls, created["session_id"])
            assert created["base_url"].startswith(f"{owner}/sessions/")
            assert (await http.get(f"{owner}/sessions/{created['session_id']}")).status_code == 200


async def test_shards_that_disagree_on_the_fleet_refuse_rather_than_loop(
    in_process_fleet: InProcessFleet,
) -> None:
    """Shard 1 lists a third URL shard 0 does not: a create shard 0 forwards
    to shard 1 that shard 1 hashes to the third is refused (500, named)."""
    elsewhere = "http://127.0.0.1:9"
    urls = await in_process_fleet(2, extra={1: (elsewhere,)})
    session_id = next(
        f"d{i}"
        for i in range(1000)
        if rendezvous_owner(urls, f"d{i}") == urls[1]
        and rendezvous_owner((*urls, elsewhere), f"d{i}") == elsewhere
    )
    async with httpx.AsyncClient(timeout=30, verify=TLS) as http:
        refused = await http.post(f"{urls[0]}/sessions", json={"session_id": session_id})
    assert refused.status_code == 500
    assert "fleet misconfigured" in refused.json()["error"]["message"]


async def test_keys_across_the_fleet(
    in_process_fleet: InProcessFleet,
) -> None:
    """In-process, with --api-key and --admin-api-key: a create forwarded to
    its owner carries the caller's key (and is refused without one), the
    session's own key reaches its turns on the owner, and a fleet-wide change
    needs the operator's key on every shard."""
    urls = await in_process_fleet(2, api_key="trainer", admin_api_key="operator")
    trainer = {"Authorization": "Bearer trainer"}
    operator = {"Authorization": "Bearer operator"}
    session_id = next(f"k{i}" for i in range(100) if rendezvous_owner(urls, f"k{i}") == urls[1])
    async with httpx.AsyncClient(timeout=30, verify=TLS) as http:
        refused = await http.post(f"{urls[0]}/sessions", json={"session_id": session_id})
        assert refused.status_code == 401
        created = await http.post(
            f"{urls[0]}/sessions", json={"session_id": session_id}, headers=trainer
        )
        assert created.status_code == 201, created.text
        doc = created.json()
        assert doc["base_url"] == f"{urls[1]}/sessions/{session_id}/v1"
        turn = await http.post(
            f"{doc['base_url']}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {doc['api_key']}"},
        )
        assert turn.status_code == 200, turn.text
        # Redirected once the edge has checked the key, like every route.
        assert (await http.get(f"{urls[0]}/sessions/{session_id}")).status_code == 401
        moved = await http.get(f"{urls[0]}/sessions/{session_id}", headers=trainer)
        assert moved.status_code == 307
        owner = await http.get(moved.headers["location"], headers=trainer)
        assert owner.status_code == 200, owner.text
        extra = "http://127.0.0.1:9"
        denied = await http.post(f"{urls[0]}/workers", json={"url": extra}, headers=trainer)
        assert denied.status_code == 403
        assert (await http.get(f"{urls[1]}/metrics?fleet=1")).status_code == 401
        added = await http.post(f"{urls[0]}/workers", json={"url": extra}, headers=operator)
        assert [s["status"] for s in added.json()["fleet"]] == [201, 201]


async def test_bulk_export_through_any_shard_exports_the_whole_fleet(
    in_process_fleet: InProcessFleet, tmp_path: Path
) -> None:
    """`rollout-session export --server SHARD --api-key KEY`: every shard's
    sessions, each read (and with --close collected) on its owner, once."""
    urls = await in_process_fleet(3, api_key="trainer")
    trainer = {"Authorization": "Bearer trainer"}
    # Two sessions on each shard.
    ids = [
        i
        for url in urls
        for i in [f"x{n}" for n in range(40) if rendezvous_owner(urls, f"x{n}") == url][:2]
    ]
    assert len(ids) == 6
    async with httpx.AsyncClient(timeout=30, verify=TLS, headers=trainer) as http:
        originals = {}
        for session_id in ids:
            created = await http.post(f"{urls[0]}/sessions", json={"session_id": session_id})
            doc = created.json()
            turn = await http.post(
                f"{doc['base_url']}/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {doc['api_key']}"},
            )
            assert turn.status_code == 200, turn.text
            owner = rendezvous_owner(urls, session_id)
            originals[session_id] = (
                await http.get(f"{owner}/sessions/{session_id}/trajectory")
            ).json()

        def export(server: str, out: str, close: bool) -> tuple[Path, int]:
            return bulk_export.export_sessions(
                server, tmp_path / out, close=close, api_key="trainer", progress=False
            )

        path, written = await trio.to_thread.run_sync(export, urls[1], "read", False)
        exported = [orjson.loads(line) for line in path.read_bytes().splitlines()]
        assert written == 6
        assert {doc["session_id"]: doc for doc in exported} == originals
        path, written = await trio.to_thread.run_sync(export, urls[2], "closed", True)
        assert written == 6
        assert {orjson.loads(line)["session_id"] for line in path.read_bytes().splitlines()} == set(
            ids
        )
        assert (await http.get(f"{urls[0]}/health?fleet=1")).json()["sessions"] == 0


async def test_a_shard_warns_of_restored_sessions_it_does_not_own(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A journal written by a one-shard fleet, replayed by shard 0 of a
    two-shard one: the sessions shard 1 now owns are named in a warning."""
    template = chat_tokenizers["chatml"]
    worker = await spawn_worker(
        nursery, text_model, EmulatorConfig(seed=0, chat_template=template.chat_template)
    )
    before, after = bind_sockets("127.0.0.1", 0, 1), bind_sockets("127.0.0.1", 0, 2)
    old, new = fleet_urls("127.0.0.1", before), fleet_urls("127.0.0.1", after)
    # Some ids, and one that the second shard of the new fleet owns.
    candidates = (f"j{i}" for i in range(1000))
    to_second = next(i for i in candidates if rendezvous_owner(new, i) == new[1])
    ids = [*(f"k{i}" for i in range(4)), to_second]
    moved = [i for i in ids if rendezvous_owner(new, i) != new[0]]
    common: dict[str, Any] = {
        "workers": (worker.url,),
        "journal": str(tmp_path),
        "journal_fsync": "never",
    }
    app = create_app(Settings(fleet=old, shard=0, **common), tokenizer=template, worker_tls=TLS)
    server = await start_server(nursery, app, bind=[f"fd://{before[0].detach()}"])
    async with httpx.AsyncClient(timeout=30, verify=TLS) as http:
        for session_id in ids:
            created = await http.post(f"{old[0]}/sessions", json={"session_id": session_id})
            assert created.status_code == 201
    await server.aclose()
    after[1].close()
    app = create_app(Settings(fleet=new, shard=0, **common), tokenizer=template, worker_tls=TLS)
    server = await start_server(nursery, app, bind=[f"fd://{after[0].detach()}"])
    assert f"{len(moved)} restored sessions (e.g. {moved[0]}" in caplog.text
    await server.aclose()


async def test_a_redirect_keeps_the_connection_and_ambiguous_framing_is_refused(
    in_process_fleet: InProcessFleet,
) -> None:
    """On a shard that does not own the session: a redirect with a body reads
    it, so the connection carries the next request; a request with both
    Content-Length and Transfer-Encoding meets the edge's refusal (400,
    closed) rather than a redirect."""
    urls = await in_process_fleet(2)
    session_id = next(f"r{i}" for i in range(1000) if rendezvous_owner(urls, f"r{i}") == urls[1])
    path = f"/sessions/{session_id}/v1/chat/completions"
    conn = await RawConnection.open(urls[0])
    try:
        moved = await conn.request("POST", path, body=b'{"messages": []}')
        assert moved.status == 307 and not moved.closes
        assert moved.headers["location"] == urls[1] + path
        again = await conn.request("GET", "/health")
        assert again.status == 200
        await conn.send_head("POST", path, {"content-length": "5", "transfer-encoding": "chunked"})
        await conn.send(b"5\r\nhello\r\n0\r\n\r\n")
        refused = await conn.response()
        assert refused.status == 400 and refused.closes
    finally:
        await conn.aclose()
