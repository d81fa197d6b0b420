"""Command line: ``rollout-session serve`` and ``rollout-session emulator``.

Every ``serve`` flag mirrors a `Settings` field and can also be given as the
environment variable ``ROLLOUT_SESSION_<FLAG>`` (dashes → underscores, upper
case); a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import trio

from ..config import Settings
from ..engines.kv_sessions import KvMode

__all__ = [
    "ENV_PREFIX",
    "SERVE_OPTIONS",
    "add_serve_arguments",
    "main",
    "settings_from_args",
    "start_demo_workers",
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


def _bool(value: str) -> bool:
    if value.lower() in {"1", "true", "yes", "on"}:
        return True
    if value.lower() in {"0", "false", "no", "off", ""}:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


# (flag, Settings field, type, help). The default always comes from Settings.
SERVE_OPTIONS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--host", "host", str, "bind address"),
    ("--port", "port", int, "bind port (0 = any free port)"),
    ("--tokenizer", "tokenizer", str, "HF tokenizer dir (default: ask the first worker)"),
    ("--chat-template", "chat_template", str, "template file, or built-in: chatml, qwen3"),
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
    (
        "--kv-sessions",
        "kv_sessions",
        str,
        "worker-side KV sessions: off, or hint (session id each turn, /close_session at "
        "the end; workers need --enable-session-radix-cache; docs/kv-sessions.md)",
    ),
    ("--default-priority", "default_priority", int, "SGLang priority of sessions without one"),
    ("--placement", "placement", str, "sticky-least-loaded, consistent-hash, round-robin"),
    ("--health-interval-s", "health_interval_s", float, "seconds between worker probes"),
    ("--health-timeout-s", "health_timeout_s", float, "worker probe timeout"),
    ("--unhealthy-after", "unhealthy_after", int, "consecutive failures → unhealthy"),
    ("--healthy-after", "healthy_after", int, "consecutive probe successes → healthy"),
    ("--circuit-failures", "circuit_failures", int, "consecutive failed turns → circuit open"),
    ("--circuit-successes", "circuit_successes", int, "half-open chat probes → circuit closed"),
    ("--circuit-open-s", "circuit_open_s", float, "seconds open before half-open probes"),
    ("--api-key", "api_key", str, "the trainer's key: sessions need it (docs/security.md)"),
    ("--admin-api-key", "admin_api_key", str, "the operator's key: workers, pause, metrics"),
    ("--session-ttl-s", "session_ttl_s", _optional_float, "idle expiry ('none' = never)"),
    ("--keep-closed-s", "keep_closed_s", float, "keep expired sessions for collection"),
    ("--keep-collected-s", "keep_collected_s", float, "collected sessions stay readable"),
    ("--max-sessions", "max_sessions", int, "more → 429 too_many_sessions"),
    ("--max-session-tokens", "max_session_tokens", int, "prompt + max_tokens cap"),
    ("--pause-wait-s", "pause_wait_s", float, "while paused, turns wait this long"),
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


class JournalStartFailed(Exception):
    """The journal could not be opened before listening (a start-up failure)."""


def _env_default(
    env: Mapping[str, str], dest: str, kind: Callable[[str], Any], default: Any
) -> Any:
    raw = env.get(ENV_PREFIX + dest.upper())
    return default if raw is None else kind(raw)


def add_serve_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    defaults = Settings(demo=True)
    for flag, dest, kind, help_text in SERVE_OPTIONS:
        default = _env_default(env, dest, kind, getattr(defaults, dest))
        parser.add_argument(flag, dest=dest, type=kind, default=default, help=help_text)
    workers_env = env.get(ENV_PREFIX + "WORKERS", "")
    parser.add_argument(
        "--worker",
        dest="workers",
        action="append",
        default=None,
        help="SGLang worker base URL (repeatable; env: comma-separated WORKERS)",
    )
    parser.set_defaults(workers_env=[w for w in workers_env.split(",") if w.strip()])
    fleet_env = env.get(ENV_PREFIX + "FLEET", "")
    parser.add_argument(
        "--fleet",
        dest="fleet",
        action="append",
        default=None,
        help="every fleet shard's URL, in order (repeatable; env: comma-separated FLEET; "
        "docs/deploy.md#a-fleet)",
    )
    parser.set_defaults(fleet_env=[u for u in fleet_env.split(",") if u.strip()])
    parser.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="serve on this bound socket, inherited, instead of --host/--port",
    )
    parser.add_argument(
        "--sglang-session-cache",
        action="store_true",
        default=_env_default(env, "sglang_session_cache", _bool, False),
        help="the same as --kv-sessions hint (kept for existing command lines)",
    )
    parser.add_argument(
        "--routed-experts",
        action="store_true",
        default=_env_default(env, "routed_experts", _bool, False),
        help="record MoE routed experts per token (R3), asking only for new positions",
    )
    parser.add_argument(
        "--auto-create-sessions",
        action="store_true",
        default=_env_default(env, "auto_create_sessions", _bool, False),
        help="a root /v1 request naming a session id never held creates that session",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        default=_env_default(env, "demo", _bool, False),
        help="start the built-in SGLang emulator in-process (no GPU needed); it uses "
        "--tokenizer and --chat-template when given",
    )
    parser.add_argument(
        "--demo-reasoning",
        action="store_true",
        default=_env_default(env, "demo_reasoning", _bool, False),
        help="demo workers answer like a reasoning model (e.g. with --chat-template qwen3)",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    values = {dest: getattr(args, dest) for _, dest, _, _ in SERVE_OPTIONS}
    if args.sglang_session_cache and values["kv_sessions"] == "off":
        values["kv_sessions"] = KvMode.HINT.value
    workers = args.workers if args.workers is not None else args.workers_env
    fleet = args.fleet if args.fleet is not None else args.fleet_env
    return Settings(
        **values,
        workers=tuple(workers),
        fleet=tuple(fleet),
        demo=args.demo,
        demo_reasoning=args.demo_reasoning,
        routed_experts=args.routed_experts,
        auto_create_sessions=args.auto_create_sessions,
    )


async def serve(settings: Settings, *, listen_fd: int | None = None) -> None:
    """Run the server (and, in demo mode, its emulator workers) until SIGINT/SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

        async def until_signal() -> None:
            async for _ in signals:
                break

        await run_server(settings, until_signal, listen_fd=listen_fd)


async def run_server(
    settings: Settings,
    until: Callable[[], Awaitable[object]],
    *,
    listen_fd: int | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the server until `until()` returns, then stop it gracefully. On
    `listen_fd`, a bound socket, instead of binding host and port; the URL
    goes to `task_status` once the server listens."""
    from ..http.app import create_app, server_context
    from ..http.serving import start_server

    async with trio.open_nursery() as nursery:
        if settings.demo:
            settings = await start_demo_workers(nursery, settings)
        app = create_app(settings)
        # Replay before the listener opens: the app's own start-up has
        # hypercorn's fixed limit, replay none (it takes what the journal takes).
        store = server_context(app).store
        try:
            await store.open_journal(settings)
        except OSError as exc:
            raise JournalStartFailed(f"journal {settings.journal}: {exc}") from exc
        bind = {} if listen_fd is None else {"bind": [f"fd://{listen_fd}"]}
        try:
            # Returns once the app has started and the socket listens (a
            # failed start raises instead: nothing below is printed).
            server = await start_server(
                nursery,
                app,
                host=settings.host,
                port=settings.port,
                max_connections=_connection_cap(settings),
                graceful_timeout=settings.shutdown_grace_s,
                **bind,
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await store.aclose()
            raise
        # Startup is done: what is loaded now (tokenizer, templates, modules)
        # lives as long as the process; keep it out of every later GC pass
        # (docs/performance.md#gc-freeze-after-start-up).
        gc.freeze()
        auth = ' -H "Authorization: Bearer $KEY"' if settings.api_key else ""
        print(f"rollout-session listening on {server.url}", flush=True)
        print(f"  create a session: curl -X POST{auth} {server.url}/sessions", flush=True)
        print(f"  inspector: {server.url}/ui", flush=True)
        task_status.started(server.url)
        await until()
        await server.aclose()
        nursery.cancel_scope.cancel()


# Descriptors the server needs besides client and worker connections: the
# event loop's, the journal's, validation processes' pipes, tokenizer files.
_FD_RESERVE = 128


def connection_cap(max_connections: int, reserve: int, fd_limit: int) -> int:
    """`max_connections`, or fewer if the process could not hold them and
    `reserve` more descriptors (`fd_limit` < 0: unlimited)."""
    if fd_limit < 0 or max_connections + reserve <= fd_limit:
        return max_connections
    return max(1, fd_limit - reserve)


def _connection_cap(settings: Settings) -> int:
    """--max-connections within the descriptors this process may open, after
    raising its soft limit toward the hard one as far as it needs (as vLLM's
    and SGLang's servers raise theirs); a lower cap is logged."""
    import resource

    reserve = _FD_RESERVE + settings.upstream_max_connections * max(1, len(settings.workers))
    wanted = settings.max_connections + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the limit we have
    limit = -1 if soft == resource.RLIM_INFINITY else soft
    cap = connection_cap(settings.max_connections, reserve, limit)
    if cap < settings.max_connections:
        logging.getLogger("rollout_session").warning(
            "the file descriptor limit (%d) holds %d client connections, not "
            "--max-connections %d: connections are capped at %d",
            soft,
            cap,
            settings.max_connections,
            cap,
        )
    return cap


async def start_demo_workers(nursery: trio.Nursery, settings: Settings) -> Settings:
    """Emulator workers speaking the served tokenizer and template (the
    bundled test tokenizer and its ChatML template unless given)."""
    try:
        from ..testing.emulator_app import start_emulator
        from ..testing.emulator_config import EmulatorConfig
        from ..testing.tokenizer import bundled_tokenizer_path
    except ImportError as exc:
        raise SystemExit(
            f"serve --demo needs the demo extra ({exc}): pip install 'rollout-session[demo]'"
        ) from None
    from ..prompt.tokenizer import read_chat_template

    tokenizer = settings.tokenizer or str(bundled_tokenizer_path())
    template = read_chat_template(settings.chat_template) if settings.chat_template else None
    urls = list(settings.workers)
    for i in range(settings.demo_workers):
        config = EmulatorConfig(
            seed=i,
            tokenizer_path=Path(tokenizer),
            chat_template=template,
            reasoning=settings.demo_reasoning,
        )
        running, _ = await start_emulator(nursery, config, host="127.0.0.1")
        print(f"demo SGLang emulator worker {i} on {running.url}", flush=True)
        urls.append(running.url)
    return replace(settings, workers=tuple(urls), tokenizer=tokenizer)


def _add_check_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings(demo=True)
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer (model) directory")
    parser.add_argument("--chat-template", help="template file, or built-in: chatml, qwen3")
    parser.add_argument("--chat-template-kwargs", type=_json_object, default={}, help="JSON object")
    parser.add_argument(
        "--append-roles",
        type=_csv,
        default=defaults.append_roles,
        help="roles agents may append (decides which cases `serve` would refuse)",
    )


def check_template_command(args: argparse.Namespace) -> int:
    """Print the conformance report; 0 if `serve` would start, else 1."""
    from ..prompt.check import check_template, format_report, startup_problems
    from ..prompt.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, args.chat_template)
    results = check_template(tokenizer, args.chat_template_kwargs)
    print(format_report(results))
    problems = startup_problems(results, args.append_roles)
    if problems:
        print("\nserve would refuse to start with this template:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("\nserve would start with this template.")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    # transformers is used for tokenizers and chat templates only; its advice
    # that models need PyTorch would be the first line of every start.
    # Its warnings proper still show.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from ..export import bulk as bulk_export
    from ..testing import emulator_cli

    parser = argparse.ArgumentParser(prog="rollout-session", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the session server")
    add_serve_arguments(serve_parser, os.environ)
    emulator_parser = commands.add_parser("emulator", help="run the SGLang emulator worker")
    emulator_cli.add_arguments(emulator_parser)
    export_parser = commands.add_parser("export", help="bulk-export sessions to JSONL/Parquet")
    bulk_export.add_arguments(export_parser)
    check_parser = commands.add_parser(
        "check-template",
        help="check that a chat template can be extended token-in/token-out exactly",
    )
    _add_check_arguments(check_parser)
    args = parser.parse_args(argv)
    if args.command == "check-template":
        sys.exit(check_template_command(args))
    if args.command == "emulator":
        emulator_cli.run(args)
        return
    if args.command == "export":
        bulk_export.run(args)
        return
    try:
        settings = settings_from_args(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # httpx logs every request at INFO: health probes alone would flood the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    try:
        if settings.processes > 1:
            from ..fleet.processes import run_fleet

            sys.exit(trio.run(run_fleet, settings))
        trio.run(partial(serve, listen_fd=args.listen_fd), settings)
    except BaseException as exc:
        reason = _startup_failure(exc)
        if reason is None:
            raise
        print(f"rollout-session: cannot start: {reason}", file=sys.stderr)
        sys.exit(1)


def _startup_failure(exc: BaseException) -> str | None:
    """Why the server could not start, found inside `exc`: the address could
    not be bound, or the app's start-up failed (hypercorn reports that as a
    lifespan failure); trio wraps either in exception groups."""
    from hypercorn.utils import LifespanFailureError

    from ..http.serving import CannotListen
    from ..session.journal.format import JournalError

    if isinstance(exc, CannotListen | JournalStartFailed | JournalError):
        return str(exc)
    if isinstance(exc, LifespanFailureError):
        # Raised while handling the app's own exception: that one says why.
        cause = exc.__cause__ or exc.__context__
        return str(cause) if cause is not None else str(exc)
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            reason = _startup_failure(inner)
            if reason is not None:
                return reason
    return None
