"""The ``serve`` flags and `Settings`, both ways: the flag table, the parser
they build, the Settings a parse gives, and the small value parsers.

Every ``serve`` flag mirrors a `Settings` field and can also be given as the
environment variable ``ROLLOUT_SESSION_<FLAG>`` (dashes → underscores, upper
case); a flag on the command line wins over the environment. Light: imports
`config` and nothing of the server (``serve --help`` and a fleet's shard
commands use it).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ..config import Settings
from ..engines.kv_sessions import KvMode
from ..engines.registry import AUTO, ENGINES, engine_flags
from ..engines.spec import boolean

__all__ = [
    "ENV_PREFIX",
    "SERVE_OPTIONS",
    "add_serve_arguments",
    "settings_from_args",
]

ENV_PREFIX = "ROLLOUT_SESSION_"


def _csv(value: str) -> frozenset[str]:
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def _json_object(value: str) -> dict[str, Any]:
    data = orjson.loads(value)
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return data


def _optional_float(value: str) -> float | None:
    return None if value.lower() in {"none", "off", ""} else float(value)


Option = tuple[str, str, Callable[[str], Any], str]

# (flag, Settings field, type, help). The default always comes from Settings.
_SERVER_OPTIONS: tuple[Option, ...] = (
    ("--host", "host", str, "bind address"),
    ("--port", "port", int, "bind port (0 = any free port)"),
    ("--tokenizer", "tokenizer", str, "HF tokenizer dir (default: ask the first worker)"),
    (
        "--chat-template",
        "chat_template",
        str,
        "one of the tokenizer's named templates, a template file, or built-in: chatml, qwen3",
    ),
    ("--chat-template-kwargs", "chat_template_kwargs", _json_object, "JSON object"),
    ("--append-roles", "append_roles", _csv, "roles an agent may append, comma-separated"),
    (
        "--on-divergence",
        "on_divergence",
        str,
        "a request that does not extend the session: segment (new segment), rollback, error",
    ),
    ("--max-rollback-turns", "max_rollback_turns", int, "turns --on-divergence rollback drops"),
    ("--prompt-mode", "prompt_mode", str, "tito (token-in/token-out) or render (whole request)"),
    ("--max-segments", "max_segments", int, "segments per session; more → 400"),
    (
        "--max-session-mb",
        "max_session_mb",
        _optional_float,
        "text a session keeps, MiB (every segment's messages, reasoning, tools, kwargs, "
        "metadata; 'none' = unbounded); more → 400 session_too_large",
    ),
    (
        "--max-messages",
        "max_messages",
        int,
        "messages a request may carry (and as many content parts, tool calls, tools), "
        "counted before parsing; more → 400",
    ),
    ("--session-header", "session_header", str, "header naming the session on /v1 at the root"),
    ("--context-length", "context_length", int, "model context (default: from worker)"),
    (
        "--upstream-model",
        "upstream_model",
        str,
        "model sent upstream: served (the name the worker or gateway lists), agent "
        "(the agent's own), or a fixed NAME",
    ),
    ("--upstream-timeout-s", "upstream_timeout_s", float, "whole-turn worker timeout"),
    ("--connect-timeout-s", "connect_timeout_s", float, "worker connect timeout"),
    ("--upstream-max-connections", "upstream_max_connections", int, "pool size per worker"),
    ("--cpu-threads", "cpu_threads", int, "threads for large parse/validate work"),
    ("--offload-threshold-kb", "offload_threshold_kb", int, "offload bodies over this size"),
    ("--parse-processes", "parse_processes", int, "processes validating large answers (0: none)"),
    ("--process-threshold-kb", "process_threshold_kb", int, "validate answers over this in one"),
    ("--max-body-mb", "max_body_mb", float, "largest accepted request body"),
    (
        "--max-answer-mb",
        "max_answer_mb",
        _optional_float,
        "largest accepted worker answer (default 64; 1024 with --routed-experts)",
    ),
    (
        "--worker-hosts",
        "worker_hosts",
        _csv,
        "allowed worker hosts: names, IPs, CIDR networks, each with an optional :port",
    ),
    ("--max-connections", "max_connections", int, "open client connections; more wait"),
    ("--default-priority", "default_priority", int, "SGLang priority of sessions without one"),
    ("--placement", "placement", str, "sticky-least-loaded, consistent-hash, round-robin"),
    ("--health-interval-s", "health_interval_s", float, "seconds between worker probes"),
    ("--health-timeout-s", "health_timeout_s", float, "worker probe timeout"),
    ("--unhealthy-after", "unhealthy_after", int, "consecutive failures → unhealthy"),
    ("--healthy-after", "healthy_after", int, "consecutive probe successes → healthy"),
    ("--circuit-failures", "circuit_failures", int, "consecutive failed turns → circuit open"),
    ("--circuit-successes", "circuit_successes", int, "half-open probes → circuit closed"),
    ("--circuit-open-s", "circuit_open_s", float, "seconds open before half-open probes"),
    (
        "--circuit-sessions",
        "circuit_sessions",
        int,
        "failed turns of this many sessions open the circuit though its probe passes",
    ),
    ("--api-key", "api_key", str, "the trainer's key: sessions need it (docs/security.md)"),
    ("--admin-api-key", "admin_api_key", str, "the operator's key: workers, pause, metrics"),
    (
        "--worker-ca",
        "worker_ca",
        str,
        "PEM file of the CA(s) that sign https workers' certificates, trusted instead of "
        "certifi's bundle (docs/deploy.md#many-hosts)",
    ),
    ("--session-ttl-s", "session_ttl_s", _optional_float, "idle expiry ('none' = never)"),
    ("--keep-closed-s", "keep_closed_s", float, "keep expired sessions for collection"),
    ("--keep-collected-s", "keep_collected_s", float, "collected sessions stay readable"),
    ("--max-sessions", "max_sessions", int, "more → 429 too_many_sessions"),
    ("--max-session-tokens", "max_session_tokens", int, "prompt + max_tokens cap"),
    ("--pause-wait-s", "pause_wait_s", float, "while paused, turns wait this long"),
    (
        "--on-abort",
        "on_abort",
        str,
        "a worker's abort answer (weight update): continue the turn, or return it",
    ),
    (
        "--on-sampling-conflict",
        "on_sampling_conflict",
        str,
        "an agent sampling value that differs from its session's pinned sampling: override "
        "(the session's is sent, counted) or refuse (400)",
    ),
    (
        "--max-continuations",
        "max_continuations",
        int,
        "requests a turn may add after aborts (and times an aborted rescore is sent again)",
    ),
    ("--shutdown-grace-s", "shutdown_grace_s", float, "SIGTERM: time for in-flight turns"),
    ("--journal", "journal", str, "durable journal directory (off by default)"),
    ("--journal-fsync", "journal_fsync", str, "always, interval or never"),
    ("--journal-fsync-interval-s", "journal_fsync_interval_s", float, "for --journal-fsync"),
    ("--journal-retry-s", "journal_retry_s", float, "after a failed write, retry after"),
    ("--demo-workers", "demo_workers", int, "emulator workers started by --demo"),
    ("--processes", "processes", int, "start this many shards on this host (a fleet)"),
    ("--shard", "shard", int, "this server's index in --fleet"),
    ("--log-level", "log_level", str, "debug, info, warning, error"),
)


def _engine_options() -> tuple[Option, ...]:
    """--engine and the engine flags, as the engine packages declare them."""
    engines = "; ".join(f"{spec.name}: {spec.summary}" for spec in ENGINES.values())
    auto = (
        f"{AUTO} (default): each worker served by the token route of its family, the "
        "settings read from the workers"
    )
    return (
        ("--engine", "engine", str, f"the inference engine (docs/engines.md). {auto}; {engines}"),
        *((flag.flag, field, flag.kind, help) for field, (flag, help) in engine_flags().items()),
    )


# Every `serve` flag that mirrors a Settings field: the server's own, then
# the engines' (from the registry).
SERVE_OPTIONS: tuple[Option, ...] = _SERVER_OPTIONS + _engine_options()


def _env_default(
    parser: argparse.ArgumentParser,
    env: Mapping[str, str],
    dest: str,
    kind: Callable[[str], Any],
    default: Any,
) -> Any:
    """`dest`'s default: its ``ROLLOUT_SESSION_<DEST>`` variable's value, read
    as its flag's would be (a bad one is a usage error naming the
    variable, as a bad flag is), else `default`."""
    name = ENV_PREFIX + dest.upper()
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{name}={raw!r}: {exc}")


# (flag, dest, help) of the repeatable URL flags; env: comma-separated
# ROLLOUT_SESSION_<DEST>.
URL_LISTS: tuple[tuple[str, str, str], ...] = (
    ("--worker", "workers", "worker base URL (repeatable; env: comma-separated WORKERS)"),
    (
        "--teacher-worker",
        "teacher_workers",
        "a worker that only scores (rescore target teacher), never takes rollouts "
        "(repeatable; env: comma-separated TEACHER_WORKERS; docs/training.md#rescoring)",
    ),
    (
        "--fleet",
        "fleet",
        "every fleet shard's URL, in order (repeatable; env: comma-separated FLEET; "
        "docs/deploy.md#a-fleet)",
    ),
)


def add_serve_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Add the ``serve`` flags to `parser`, their defaults from `env` or `Settings`."""
    defaults = Settings(demo=True)
    for flag, dest, kind, help_text in SERVE_OPTIONS:
        default = _env_default(parser, env, dest, kind, getattr(defaults, dest))
        parser.add_argument(flag, dest=dest, type=kind, default=default, help=help_text)
    # URL lists: the flag repeated, else the variable's comma-separated list.
    for flag, dest, help_text in URL_LISTS:
        parser.add_argument(flag, dest=dest, action="append", default=None, help=help_text)
        listed = env.get(ENV_PREFIX + dest.upper(), "")
        parser.set_defaults(**{f"{dest}_env": [u for u in listed.split(",") if u.strip()]})
    parser.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="serve on this bound socket, inherited, instead of --host/--port",
    )
    parser.add_argument(
        "--sglang-session-cache",
        action="store_true",
        default=_env_default(parser, env, "sglang_session_cache", boolean, False),
        help="the same as --kv-sessions hint (kept for existing command lines)",
    )
    parser.add_argument(
        "--routed-experts",
        action="store_true",
        default=_env_default(parser, env, "routed_experts", boolean, False),
        help="record MoE routed experts per token (R3), asking only for new positions",
    )
    parser.add_argument(
        "--auto-create-sessions",
        action="store_true",
        default=_env_default(parser, env, "auto_create_sessions", boolean, False),
        help="a root /v1 request naming a session id never held creates that session",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        default=_env_default(parser, env, "demo", boolean, False),
        help="start built-in emulator workers of the engine in-process (no GPU needed); it uses "
        "--tokenizer and --chat-template when given",
    )
    parser.add_argument(
        "--demo-reasoning",
        action="store_true",
        default=_env_default(parser, env, "demo_reasoning", boolean, False),
        help="demo workers answer like a reasoning model (e.g. with --chat-template qwen3)",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The `Settings` a parse of the ``serve`` flags names (validated: a bad
    value raises ValueError or TypeError)."""
    values = {dest: getattr(args, dest) for _, dest, _, _ in SERVE_OPTIONS}
    if args.sglang_session_cache and values["kv_sessions"] == "off":
        values["kv_sessions"] = KvMode.HINT.value
    lists: dict[str, Any] = {
        dest: tuple(getattr(args, dest) or getattr(args, f"{dest}_env")) for _, dest, _ in URL_LISTS
    }
    return Settings(
        **values,
        **lists,
        demo=args.demo,
        demo_reasoning=args.demo_reasoning,
        routed_experts=args.routed_experts,
        auto_create_sessions=args.auto_create_sessions,
    )
