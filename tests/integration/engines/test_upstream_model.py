"""What the session server asks a worker or gateway, and what it no longer
lets pass in silence: `--upstream-model`, routed experts that are missing,
best-effort calls that fail (docs/deploy.md#behind-smg-the-sglang-gateway)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

import pytest
import trio

from rollout_session import Settings
from rollout_session.cli.options import add_serve_arguments, settings_from_args
from rollout_session.emulator import EmulatorConfig
from tests.conftest import StackFactory

SERVED = EmulatorConfig().model_name
HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("setting", "asked", "sent"),
    [
        ("served", "any", SERVED),
        ("served", None, SERVED),
        ("served", f"{SERVED}:adapter", f"{SERVED}:adapter"),
        ("agent", "any", "any"),
        ("agent", None, SERVED),
        ("gateway-alias", "any", "gateway-alias"),
    ],
    ids=[
        "served-replaces",
        "served-fills",
        "served-lora-kept",
        "agent-kept",
        "agent-fills",
        "fixed-name",
    ],
)
async def test_upstream_model_decides_the_model_sent(
    make_stack: StackFactory, setting: str, asked: str | None, sent: str
) -> None:
    # Before: the agent's "any" was sent as is, and a gateway routing on
    # `model` (smg) answered 404 "No worker available for model 'any'".
    stack = await make_stack(upstream_model=setting)
    session_id = await stack.create()
    body = {"messages": HELLO} | ({"model": asked} if asked else {})
    response = await stack.chat(session_id, **body)
    assert response.status_code == 200, response.text
    assert stack.emulator.requests[-1].body["model"] == sent
    # The export records the model that answered (the worker echoes what it was sent).
    assert (await stack.trajectory(session_id))["model"] == sent


async def test_a_model_the_workers_list_is_sent_as_asked(make_stack: StackFactory) -> None:
    """vLLM lists each LoRA adapter by name in /v1/models: an agent naming one
    keeps it under the default --upstream-model served (never silently the base)."""
    stack = await make_stack()
    pool = stack.ctx.pool
    await pool.wait_until(lambda: pool.served is not None)
    assert pool.served is not None
    # As if the worker listed an adapter too (the emulator serves one model).
    pool._health.served = replace(pool.served, models=(*pool.served.models, "my-adapter"))
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=HELLO, model="my-adapter")
    assert response.status_code == 200, response.text
    assert stack.emulator.requests[-1].body["model"] == "my-adapter"


def test_the_default_sends_the_served_model() -> None:
    assert Settings(workers=("http://127.0.0.1:1",)).upstream_model == "served"


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, "served"),
        ([], {"ROLLOUT_SESSION_UPSTREAM_MODEL": "agent"}, "agent"),
        (["--upstream-model", "alias"], {"ROLLOUT_SESSION_UPSTREAM_MODEL": "agent"}, "alias"),
    ],
    ids=["default", "environment", "flag-wins"],
)
def test_upstream_model_flag_and_environment(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env)
    settings = settings_from_args(parser.parse_args(["--worker", "http://w:1", *argv]))
    assert settings.upstream_model == expected


@pytest.mark.parametrize("value", ["", " padded", "line\nbreak"], ids=["empty", "padded", "ctrl"])
def test_upstream_model_must_be_a_plain_name(value: str) -> None:
    with pytest.raises(ValueError, match="upstream_model"):
        Settings(workers=("http://127.0.0.1:1",), upstream_model=value)


async def test_routed_experts_missing_from_the_answer_is_a_502(make_stack: StackFactory) -> None:
    # Before: a worker without routed experts (SGLang without
    # --enable-return-routed-experts, a dense model) passed as a model with none.
    stack = await make_stack(
        routed_experts=True, emulator=EmulatorConfig(return_routed_experts=False)
    )
    session_id = await stack.create()
    response = await stack.chat(session_id, messages=HELLO)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "upstream_malformed" and "routed_experts" in error["message"]
    assert stack.emulator.requests[-1].body["return_routed_experts"] is True
    assert (await stack.trajectory(session_id))["turns"] == []


async def test_failed_close_session_is_logged_once_per_worker(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: logged at INFO on every call, and a non-2xx answer (a gateway's
    # 404) not at all.
    stack = await make_stack(kv_sessions="hint")
    ids = [await stack.create() for _ in range(3)]
    for session_id in ids:
        assert (await stack.chat(session_id, messages=HELLO)).status_code == 200
    stack.workers[0].kill()  # /close_session now fails to connect
    pool = stack.ctx.pool
    worker = pool.workers[stack.emulator_url]
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        for session_id in ids:
            assert (await stack.client.delete(f"/sessions/{session_id}")).status_code == 200
        with trio.fail_after(10):
            await pool.wait_until(lambda: worker.control_failures["POST /close_session"] == 3)
    logged = [r for r in caplog.records if "/close_session" in r.getMessage()]
    assert len(logged) == 1
    assert stack.emulator_url in logged[0].getMessage()
    assert logged[0].levelno == logging.WARNING
    listed = (await stack.client.get("/workers")).json()["workers"][0]
    assert listed["control_failures"] == {"POST /close_session": 3}
    metrics = (await stack.client.get("/metrics")).text
    assert 'rollout_control_failures_total{call="POST /close_session"} 3.0' in metrics


async def test_failed_health_probes_say_why_once(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: "GET /health did not answer 200", whatever happened.
    stack = await make_stack(health_interval_s=0.05, health_timeout_s=0.5, unhealthy_after=2)
    pool = stack.ctx.pool
    worker = pool.workers[stack.emulator_url]
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        stack.workers[0].kill()
        with trio.fail_after(10):
            await pool.wait_until(lambda: worker.consecutive_failures >= 5)
    assert str(worker.last_error).startswith("GET /health: ConnectError")
    reasons = [r for r in caplog.records if "GET /health" in r.getMessage()]
    assert len(reasons) == 1 and stack.emulator_url in reasons[0].getMessage()
