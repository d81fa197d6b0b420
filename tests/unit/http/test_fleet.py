"""A fleet's settings, and a shard's command line built from them (fleet_processes.py)."""

from __future__ import annotations

import pytest

from rollout_session.client import SessionClient, rendezvous_owner
from rollout_session.config import Settings
from rollout_session.fleet.processes import shard_command
from rollout_session.http.fleet import Fleet, own_url

WORKER = "http://127.0.0.1:30000"
URLS = ("http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002")


def test_fleet_urls_are_normalised_and_this_shard_is_one_of_them() -> None:
    settings = Settings(workers=(WORKER,), fleet=("http://a:1/", "http://b:2"), shard=1)
    assert settings.fleet == ("http://a:1", "http://b:2")
    assert own_url(settings) == "http://b:2"
    assert own_url(Settings(workers=(WORKER,))) == ""


@pytest.mark.parametrize(
    ("fleet", "shard", "processes", "message"),
    [
        (URLS, 3, 1, "shard must be in 0..2"),
        ((URLS[0], URLS[0] + "/"), 0, 1, "distinct"),
        (("127.0.0.1:8000",), 0, 1, "is not an http"),
        (URLS[:2], 0, 3, "one fleet URL per process"),
        ((), 0, 0, "processes must be >= 1"),
    ],
    ids=["shard-out-of-range", "duplicate", "no-scheme", "count-mismatch", "no-processes"],
)
def test_bad_fleets_are_refused(
    fleet: tuple[str, ...], shard: int, processes: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(workers=(WORKER,), fleet=fleet, shard=shard, processes=processes)


def test_a_shard_owns_what_the_client_sends_it() -> None:
    client = SessionClient(URLS)
    for i in range(50):
        session_id = f"s{i}"
        owner = client.server_for(session_id)
        assert owner == rendezvous_owner(URLS, session_id)
        assert [Fleet(URLS, k).owns(session_id) for k in range(3)].count(True) == 1
        assert Fleet(URLS, URLS.index(owner)).owns(session_id)


def test_shard_command_carries_every_setting_and_keeps_keys_off_the_command_line() -> None:
    settings = Settings(
        workers=(WORKER,),
        teacher_workers=("http://10.0.0.9:30000",),
        fleet=URLS,
        shard=2,
        port=8002,
        api_key="trainer-key",
        admin_api_key="operator-key",
        chat_template_kwargs={"enable_thinking": False},
        append_roles=frozenset({"tool", "user", "system"}),
        session_ttl_s=None,
        routed_experts=True,
        journal="/tmp/j/shard-2",
    )
    command, env = shard_command(settings, listen_fd=7)  # parses it back, or raises
    joined = " ".join(command)
    assert "trainer-key" not in joined and "operator-key" not in joined
    assert env["ROLLOUT_SESSION_API_KEY"] == "trainer-key"
    assert env["ROLLOUT_SESSION_ADMIN_API_KEY"] == "operator-key"
    assert command[-2:] == ["--listen-fd", "7"]
    assert "--routed-experts" in command and "--session-ttl-s" in command
