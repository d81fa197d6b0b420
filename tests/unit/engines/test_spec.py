"""What an engine package declares: its flags name the `Settings` fields
they set, and each spec builds its engine over the app's parts."""

from __future__ import annotations

import httpx
import pytest

from rollout_session.config import Settings
from rollout_session.engines.pool import WorkerPool
from rollout_session.engines.registry import ENGINES
from rollout_session.engines.served_model import ServedModel
from rollout_session.engines.spec import EngineFlag, EngineParts
from tests.unit.engines.pool.parts import Inline


def test_a_flag_sets_the_field_of_its_name() -> None:
    assert EngineFlag("--tool-call-parser", "x").field == "tool_call_parser"
    assert EngineFlag("--kv-sessions", "x").field == "kv_sessions"


def test_every_flag_an_engine_declares_is_a_settings_field() -> None:
    fields = set(Settings.__dataclass_fields__)
    for spec in ENGINES.values():
        assert {flag.field for flag in spec.flags} <= fields, spec.name
        assert all(spec.takes(flag.field) for flag in spec.flags)
        assert not spec.takes("placement")


@pytest.mark.parametrize("name", list(ENGINES), ids=str)
async def test_each_spec_builds_its_engine_over_the_pool_it_is_given(name: str) -> None:
    settings = Settings(workers=("http://127.0.0.1:1",), engine=name)
    spec = ENGINES[name]
    pool = WorkerPool(
        settings.pool_options(spec.dialect), Inline(), tls=httpx.create_ssl_context(trust_env=False)
    )
    assert pool.dialect is spec.dialect  # the pool speaks the engine's dialect
    engine = spec.build(settings, EngineParts(pool, ServedModel(pool)))
    assert engine.can_continue is (name != "sglang-chat")  # the chat route cannot continue
    assert list(engine.counters()) == []
    await pool.aclose()
