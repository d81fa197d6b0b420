"""Settings validation and the CLI/environment mapping."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import pytest
import trustme

from rollout_session import Settings
from rollout_session.cli.options import add_serve_arguments, settings_from_args


@pytest.mark.parametrize(
    "kwargs",
    [
        {"workers": ()},
        {"workers": ("localhost:30000",)},
        {"workers": ("http://w",), "port": 70000},
        {"workers": ("http://w",), "append_roles": frozenset({"wizard"})},
        {"workers": ("http://w",), "append_roles": frozenset()},
        {"workers": ("http://w",), "max_rollback_turns": -1},
        {"workers": ("http://w",), "upstream_timeout_s": 0},
        {"workers": ("http://w",), "cpu_threads": 0},
        {"workers": ("http://w",), "log_level": "loud"},
        {"workers": ("http://w",), "kv_sessions": "always"},
        {"workers": ("http://w",), "default_priority": 1 << 63},
        {"workers": ("http://w",), "teacher_workers": ("http://w",)},
        {"workers": ("http://w",), "teacher_workers": ("w:1",)},
        {"workers": ("http://w",), "max_session_mb": 0},
        {"workers": ("http://w",), "max_messages": 0},
        {"engine": "sglang-generate"},
        {"tokenizer": "/t"},
    ],
    ids=[
        "no-worker",
        "no-scheme",
        "port",
        "role",
        "no-roles",
        "rollback",
        "timeout",
        "threads",
        "log-level",
        "kv-sessions",
        "priority",
        "teacher-is-a-worker",
        "teacher-no-scheme",
        "session-budget",
        "max-messages",
        "no-worker-no-tokenizer",
        "no-worker-engine-auto",
    ],
)
def test_invalid_settings_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Settings(**kwargs)  # type: ignore[arg-type]


def test_without_workers_the_engine_and_the_tokenizer_are_named() -> None:
    """Workers then join at run time (POST /workers); nothing to read first."""
    settings = Settings(engine="sglang-generate", tokenizer="/t", skip_tokenizer_init=True)
    assert settings.workers == ()


def test_settings_are_frozen_and_normalised() -> None:
    settings = Settings(workers=("http://w:1/",), chat_template_kwargs={"a": 1})
    assert settings.workers == ("http://w:1",)
    with pytest.raises(AttributeError):
        settings.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.chat_template_kwargs["a"] = 2  # type: ignore[index]


def parse(argv: list[str], env: dict[str, str]) -> Settings:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, env)
    return settings_from_args(parser.parse_args(argv))


def test_flags_and_environment() -> None:
    env = {
        "ROLLOUT_SESSION_WORKERS": "http://a:1,http://b:2",
        "ROLLOUT_SESSION_MAX_ROLLBACK_TURNS": "3",
        "ROLLOUT_SESSION_APPEND_ROLLES_TYPO": "ignored",
    }
    settings = parse(["--append-roles", "tool,user,system", "--port", "0"], env)
    assert settings.workers == ("http://a:1", "http://b:2")
    assert settings.max_rollback_turns == 3
    assert settings.append_roles == {"tool", "user", "system"}
    flag_wins = parse(["--worker", "http://c:3", "--max-rollback-turns", "0"], env)
    assert flag_wins.workers == ("http://c:3",) and flag_wins.max_rollback_turns == 0
    demo = parse(["--demo", "--chat-template-kwargs", '{"enable_thinking": false}'], {})
    assert (
        demo.demo and demo.workers == () and demo.chat_template_kwargs == {"enable_thinking": False}
    )


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [("DEMO", "maybe", "not a boolean"), ("PORT", "x", "invalid literal")],
    ids=["boolean", "integer"],
)
def test_a_bad_environment_value_is_a_usage_error_naming_it(
    variable: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse([], {f"ROLLOUT_SESSION_{variable}": value})
    assert exited.value.code == 2
    assert f"ROLLOUT_SESSION_{variable}={value!r}: {said}" in capsys.readouterr().err


def test_limits_beyond_tokens_by_flag_or_environment() -> None:
    defaults = parse(["--worker", "http://w:1"], {})
    assert defaults.turn_limits().max_session_bytes == 64 * 2**20
    assert defaults.turn_limits().max_messages == 10_000
    env = {"ROLLOUT_SESSION_MAX_SESSION_MB": "none", "ROLLOUT_SESSION_MAX_MESSAGES": "50"}
    unbounded = parse(["--worker", "http://w:1"], env)
    assert unbounded.max_session_bytes is None and unbounded.max_messages == 50
    flags = ["--worker", "http://w:1", "--max-session-mb", "0.5", "--max-messages", "7"]
    limits = parse(flags, env).turn_limits()
    assert (limits.max_session_bytes, limits.max_messages) == (2**19, 7)


def test_teacher_workers_by_flag_or_environment() -> None:
    env = {"ROLLOUT_SESSION_TEACHER_WORKERS": "http://t:1,http://t:2"}
    assert parse(["--worker", "http://w:1"], env).teacher_workers == ("http://t:1", "http://t:2")
    flags = ["--worker", "http://w:1", "--teacher-worker", "http://t:3/"]
    assert parse(flags, env).teacher_workers == ("http://t:3",)


def test_kv_sessions_stream_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="outside the evictable cache"):
        Settings(workers=("http://w",), kv_sessions="stream")


def test_the_old_session_cache_flag_is_hint() -> None:
    assert parse(["--demo", "--sglang-session-cache"], {}).kv_sessions == "hint"
    assert parse(["--demo", "--kv-sessions", "hint"], {}).kv_sessions == "hint"
    env = {"ROLLOUT_SESSION_KV_SESSIONS": "hint", "ROLLOUT_SESSION_DEFAULT_PRIORITY": "-2"}
    settings = parse(["--demo"], env)
    assert (settings.kv_sessions, settings.default_priority) == ("hint", -2)


@pytest.mark.parametrize(
    ("content", "reason"),
    [(None, "No such file"), (b"not a certificate\n", "does not load as PEM")],
    ids=["missing", "not-pem"],
)
def test_a_worker_ca_that_does_not_load_is_refused_at_start(
    tmp_path: Path, content: bytes | None, reason: str
) -> None:
    ca = tmp_path / "ca.pem"
    if content is not None:
        ca.write_bytes(content)
    with pytest.raises(ValueError, match=reason):
        parse(["--worker", "https://w:1", "--worker-ca", str(ca)], {})


def test_worker_ca_by_flag_or_environment(tmp_path: Path) -> None:
    """The file's CA is the workers' whole trust store."""
    ca = trustme.CA()
    pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(pem))
    for argv, env in [
        (["--worker-ca", str(pem)], {}),
        ([], {"ROLLOUT_SESSION_WORKER_CA": str(pem)}),
    ]:
        settings = parse(["--worker", "https://w:1", *argv], env)
        assert settings.worker_ca == str(pem)
        context = settings.worker_tls()
        assert context is not None and context.verify_mode is ssl.CERT_REQUIRED
        assert len(context.get_ca_certs()) == 1  # the private CA alone
    assert Settings(workers=("https://w:1",)).worker_tls() is None
