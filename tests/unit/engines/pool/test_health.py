"""Health from probes: admission, the served model, /health rounds, and what
a worker says about itself. Probes go to a stand-in transport; the dialect's
model reading is the test dialect's (`parts.DIALECT`)."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from rollout_session.engines.pool.health import HealthChecks, differences, settings_problem
from rollout_session.engines.pool.membership import Membership
from rollout_session.engines.pool.worker import Health
from rollout_session.errors import NoHealthyWorker
from tests.unit.engines.pool.parts import CARD, options


class Workers:
    """Answers the pool's probes: /health by each host's status, /server_info as set."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.server_info: dict[str, object] = {}
        self.asked: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.asked.append(f"{request.url.host}:{request.url.port}{request.url.path}")
        base = f"http://{request.url.host}:{request.url.port}"
        if request.url.path == "/server_info":
            return httpx.Response(200, json=self.server_info)
        return httpx.Response(self.status.get(base, 200))


def checks(workers: Workers, **changes: object) -> tuple[Membership, HealthChecks]:
    opts = options(**changes)
    members = Membership(opts, httpx.create_ssl_context(trust_env=False))
    client = httpx.AsyncClient(transport=httpx.MockTransport(workers))
    return members, HealthChecks(members, opts, client, clock=lambda: 1.0)


async def test_a_round_admits_workers_that_serve_the_model() -> None:
    workers = Workers()
    members, health = checks(workers)
    good = members.add("http://127.0.0.1:9001")
    down = members.add("http://127.0.0.1:9002")
    workers.status[down.url] = 503
    await health.round()
    assert health.served == CARD and health.first_round.is_set()
    assert (good.health, good.model, good.last_checked_at) == (Health.HEALTHY, "m", 1.0)
    assert down.health is Health.JOINING
    assert down.last_error == "GET /health answered 503"
    assert await health.model_info() == CARD


async def test_the_served_model_is_the_first_admitted_in_pool_order() -> None:
    workers = Workers()
    members, health = checks(workers)
    other = members.add("http://127.0.0.1:9001/other")  # serves "o"
    same = members.add("http://127.0.0.1:9002")
    await health.round()
    assert health.served is not None and health.served.model == "o"
    assert other.health is Health.HEALTHY
    assert same.health is Health.JOINING and same.last_error == "serves m, not o"


async def test_a_worker_that_is_not_the_engines_is_never_admitted() -> None:
    workers = Workers()
    members, health = checks(workers)
    refused = members.add("http://127.0.0.1:9001/refuse")
    await health.round()
    assert refused.health is Health.JOINING and health.served is None
    assert refused.last_error == "not this engine's worker"
    with pytest.raises(NoHealthyWorker, match="no Test worker has been admitted yet"):
        await health.model_info()


async def test_failed_probes_make_a_worker_unhealthy_and_admissions_bring_it_back() -> None:
    workers = Workers()
    members, health = checks(workers, unhealthy_after=2, healthy_after=2)
    worker = members.add("http://127.0.0.1:9001")
    states = []
    for status in (200, 500, 500, 200, 200):
        workers.status[worker.url] = status
        await health.round()
        states.append(worker.health)
    assert states == [
        Health.HEALTHY,  # admitted
        Health.HEALTHY,  # one failure of two
        Health.UNHEALTHY,
        Health.UNHEALTHY,  # one admission check of two
        Health.HEALTHY,
    ]


async def test_a_worker_that_joins_a_running_pool_is_checked_at_once(
    nursery: trio.Nursery,
) -> None:
    workers = Workers()
    members, health = checks(workers)
    members.nursery = nursery
    members.add("http://127.0.0.1:9001")
    await health.round()
    late = members.add("http://127.0.0.1:9002")
    health.admit_soon(late)
    await members.wait_until(lambda: late.health is Health.HEALTHY)


async def test_kv_hints_warn_once_when_the_worker_does_not_honour_them(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    workers = Workers()
    workers.server_info = {"enable_session_radix_cache": False}
    members, health = checks(workers, sends_session_hints=True)
    members.nursery = nursery
    worker = members.add("http://127.0.0.1:9001")
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        await health.round()
        await members.wait_until(lambda: worker.session_hints is not None)
        await health.round()
    assert worker.session_hints is False
    assert caplog.text.count("does not report enable_session_radix_cache") == 1


@pytest.mark.parametrize(
    "info", [None, [1, 2], "text"], ids=["not-json-object-null", "list", "string"]
)
async def test_server_info_that_is_not_an_object_reads_as_nothing(info: object) -> None:
    workers = Workers()
    workers.server_info = info  # type: ignore[assignment]
    _, health = checks(workers)
    assert await health.server_info("http://127.0.0.1:9001") == {}


SUPPLIED = frozenset({"tool_call_parser"})


@pytest.mark.parametrize(
    ("worker", "problem"),
    [
        ({"tool_call_parser": "qwen25"}, None),
        ({}, None),
        ({"tool_call_parser": None}, None),
        (
            {"tool_call_parser": "hermes"},
            "runs --tool-call-parser hermes, where this server expects --tool-call-parser qwen25",
        ),
        (
            {"tool_call_parser": "qwen25", "skip_tokenizer_init": True},
            "runs --skip-tokenizer-init, where the pool's workers run no --skip-tokenizer-init",
        ),
    ],
    ids=["agrees", "publishes-nothing", "runs-none-supplied", "disagrees", "differs-from-pool"],
)
def test_a_worker_joins_only_with_the_settings_the_server_expects(
    worker: dict[str, object], problem: str | None
) -> None:
    expected = {"tool_call_parser": "qwen25"}
    served = {"tool_call_parser": "qwen25", "skip_tokenizer_init": False}
    assert settings_problem(worker, expected, served, SUPPLIED) == problem


def test_a_setting_not_supplied_must_be_run_by_the_worker() -> None:
    """Without the server supplying it, a worker that runs none disagrees."""
    assert differences({"tool_call_parser": None}, {"tool_call_parser": "qwen25"}) == [
        ("tool_call_parser", None, "qwen25")
    ]
    assert differences({"tool_call_parser": None}, {"tool_call_parser": "qwen25"}, SUPPLIED) == []
