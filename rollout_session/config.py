"""Server settings: one frozen dataclass, validated on construction.

The CLI (``cli/options.py``) builds it from flags and ``ROLLOUT_SESSION_*`` variables;
tests and embedders build it directly. Nothing else reads the environment.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .engines.kv_sessions import KV_MODES, PRIORITY_RANGE, STREAM_REFUSED, KvMode, is_priority
from .engines.pool import PoolOptions, WorkerDialect
from .engines.pool.placement import PLACEMENTS
from .engines.registry import DEFAULT_ENGINE, refuse_unserved
from .engines.served_model import UPSTREAM_MODEL_AGENT, UPSTREAM_MODEL_SERVED
from .engines.worker_urls import WorkerHosts, worker_url
from .prompt.messages import KNOWN_ROLES
from .session.segments import OnDivergence, PromptMode
from .session.store import JournalOptions
from .turn.interrupted import OnAbort
from .turn.limits import TurnLimits
from .turn.plan import TurnPolicy
from .turn.sampling import OnSamplingConflict

__all__ = ["Settings"]

ON_DIVERGENCE = tuple(p.value for p in OnDivergence)
ON_ABORT = tuple(p.value for p in OnAbort)
ON_SAMPLING_CONFLICT = tuple(p.value for p in OnSamplingConflict)
PROMPT_MODES = tuple(m.value for m in PromptMode)
# --max-answer-mb's default: far above any chat answer without routed
# experts; with them an answer carries ~5 bytes per layer and expert slot for
# each new position (docs/reliability.md#worker-answers).
_MAX_ANSWER_MB = 64.0
_MAX_ANSWER_MB_EXPERTS = 1024.0


@dataclass(frozen=True, kw_only=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    # Worker base URLs, e.g. "http://10.0.0.5:30000" (no trailing /v1).
    workers: tuple[str, ...] = ()
    # Workers that only score (rescore target "teacher"): a pool of their
    # own, health-checked like the rest, never given a rollout turn.
    teacher_workers: tuple[str, ...] = ()
    # Hosts a worker URL may name (names, addresses, CIDR networks, each with
    # an optional :port); None = any (engines/worker_urls.py).
    worker_hosts: frozenset[str] | None = None
    # PEM file of the CA certificates `https` workers (teachers too) are
    # verified with, instead of certifi's bundle (a private CA); like curl's
    # --cacert it is the whole trust store for workers. None = certifi's.
    worker_ca: str | None = None
    # HF tokenizer directory; None = ask the first worker's /get_model_info.
    tokenizer: str | None = None
    # Chat template file (or a built-in name: chatml, qwen3); None = tokenizer's own.
    chat_template: str | None = None
    # Defaults merged under each request's own `chat_template_kwargs`.
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # Roles an agent may append after the assistant's last answer (system and
    # developer join when the start-up template check finds them rendered in
    # place exactly).
    append_roles: frozenset[str] = frozenset({"tool", "user"})
    # A request that does not extend the session (segments.OnDivergence):
    # segment, rollback or error.
    on_divergence: str = "segment"
    # Turns --on-divergence rollback may drop.
    max_rollback_turns: int = 1
    # How later turns' prompts are built (segments.PromptMode): tito or render.
    prompt_mode: str = "tito"
    # The header that names a session on the root model routes (/v1/…).
    session_header: str = "X-Session-ID"
    # A root model request naming an id never held creates that session.
    auto_create_sessions: bool = False
    # Segments per session: each holds up to a context of tokens, so this
    # bounds a session's memory (docs/reliability.md).
    max_segments: int = 1000
    # The text a session keeps (every segment's messages, reasoning and
    # fields the template never renders included, its tools, template kwargs
    # and metadata), in MiB: token caps do not see text that is never
    # rendered (docs/reliability.md#what-a-session-keeps). None = unbounded.
    max_session_mb: float | None = 64.0
    # Messages (Responses input items) a request may carry; as many content
    # parts and tool calls over them, and as many tools: counted before
    # anything is built (docs/security.md#request-bodies).
    max_messages: int = 10_000
    # Model context in tokens; None = the worker's `max_model_len` if it reports one.
    context_length: int | None = None
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    # Connections per worker client: httpcore scans its whole pool per request.
    upstream_max_connections: int = 64
    cpu_threads: int = 2
    # Parse/validate on a thread only above this: msgspec/orjson hold the GIL,
    # so a thread hop for a large answer costs more than it saves
    # (docs/performance.md#parsing-on-the-loop-not-on-threads).
    offload_threshold_kb: int = 8192
    # Worker answers over this size are validated in one of `parse_processes`
    # worker processes (0 = never): off the GIL, so a burst of large answers
    # does not stall the loop (docs/performance.md#validation-off-the-loop).
    parse_processes: int = 2
    process_threshold_kb: int = 256
    # Text-only chat bodies are bounded by the context: a 1M-token conversation
    # is a few MB of JSON (docs/security.md#request-bodies).
    max_body_mb: float = 16.0
    # Open client connections; more wait in the listen backlog until one closes.
    max_connections: int = 4096
    # A worker's answer over this is refused (502) and its connection closed;
    # None = 64, or 1024 with routed_experts.
    max_answer_mb: float | None = None
    # Placement policy: sticky-least-loaded, consistent-hash or round-robin.
    placement: str = "sticky-least-loaded"
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 3
    healthy_after: int = 2
    # Circuit breaker on real traffic (sgl-model-gateway's defaults,
    # docs/reliability.md#failing-workers): this many failed turns in a row
    # open it (no pins), after `circuit_open_s` probes test the worker
    # and `circuit_successes` in a row close it. Failures the worker answered
    # open it only if they come from `circuit_sessions` sessions or more, or
    # its probe fails too (fewer sessions' failures are their requests').
    circuit_failures: int = 5
    circuit_successes: int = 2
    circuit_open_s: float = 30.0
    circuit_sessions: int = 3
    # The inference engine behind the seam: a name in engines.registry, or
    # "auto" (the token route of the workers' family, chosen at start-up
    # from what they say: engines/resolve.py; docs/engines.md).
    engine: str = DEFAULT_ENGINE
    # Engine flags: each engine declares those it takes (its spec's `flags`);
    # another engine's must stay at their defaults. The workers'
    # --tool-call-parser / --reasoning-parser (the engine's own names): what
    # a token-route translation must reproduce of them, and which parsers
    # parse on the worker.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # The SGLang workers' --skip-tokenizer-init (sglang-generate): None =
    # as they publish it (a server started without workers learns it from
    # the first to join); named, it must agree with them.
    skip_tokenizer_init: bool | None = None
    # Worker-side KV sessions (kv_sessions.KvMode, docs/kv-sessions.md): off,
    # hint (the session id on each turn, /close_session when it ends), or
    # delta (each turn sends only the ids the worker lacks).
    kv_sessions: str = "off"
    # The workers' scheduling `priority` for sessions created without one; None = not sent.
    default_priority: int | None = None
    # R3: ask workers for routed experts of new positions; store and export them.
    routed_experts: bool = False
    # The `model` every turn is sent upstream with: "served" (the name the
    # worker or gateway lists first in /v1/models), "agent" (the agent's own,
    # the served name when it sent none) or a fixed name. A gateway routes on
    # it: an agent's "model": "any" would find no worker there.
    upstream_model: str = UPSTREAM_MODEL_SERVED
    # The trainer's key: sessions and their model routes need it (or a
    # session's own key, derived from it) when set (docs/security.md).
    api_key: str | None = None
    # The operator's key: workers, pause/resume and /metrics need it when set
    # (else the trainer's key reaches them).
    admin_api_key: str | None = None
    # Idle sessions expire after this (per-session `ttl_s` overrides); None = never.
    session_ttl_s: float | None = 3600.0
    # Expired sessions' documents are kept this long for collection.
    keep_closed_s: float = 3600.0
    # Collected (DELETEd) sessions stay readable this long, so a DELETE whose
    # answer was lost can be repeated; 0 = forgotten at the reaper's next pass.
    keep_collected_s: float = 600.0
    max_sessions: int = 100_000
    # Prompt + max_tokens cap per session (below the model's context); None = model's.
    max_session_tokens: int | None = None
    # While paused (weight sync), new turns wait this long, then 503 server_paused.
    pause_wait_s: float = 30.0
    # A worker's `abort` answer (a weight update, a pause): continue the
    # turn from prompt + partial ids, or return the abort to the agent.
    on_abort: str = "continue"
    # Requests a turn may take after its first was aborted; past it the
    # turn fails (503 turn_interrupted), nothing committed.
    max_continuations: int = 8
    # An agent sampling value that differs from its session's pinned
    # `sampling` (turn/sampling.py): override (the session's is sent, the
    # conflict counted) or refuse (400).
    on_sampling_conflict: str = "override"
    # SIGTERM: in-flight turns get this long to finish before they are
    # cancelled; below Kubernetes' default 30 s grace, leaving time to close.
    shutdown_grace_s: float = 25.0
    # Durable journal directory (None = off) and its fsync policy.
    journal: str | None = None
    journal_fsync: str = "interval"
    journal_fsync_interval_s: float = 1.0
    # After a failed journal write, the writer tries again after this, then
    # backing off to 30 s; changes answer 503 journal_unavailable meanwhile.
    journal_retry_s: float = 1.0
    # A fleet (docs/deploy.md#a-fleet): every session server's URL, as agents
    # and `SessionClient` reach it, the same list in the same order on every
    # one; this server is `fleet[shard]`. Empty: a server on its own.
    fleet: tuple[str, ...] = ()
    shard: int = 0
    # `serve --processes N`: start N shards on this host (fleet/processes.py).
    processes: int = 1
    demo: bool = False
    demo_workers: int = 1
    # Demo workers answer with reasoning (where the chat template shows it).
    demo_reasoning: bool = False
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.worker_hosts is not None:
            object.__setattr__(self, "worker_hosts", frozenset(self.worker_hosts))
        allowed = self.allowed_worker_hosts
        object.__setattr__(self, "workers", tuple(worker_url(u, allowed) for u in self.workers))
        object.__setattr__(
            self, "teacher_workers", tuple(worker_url(u, allowed) for u in self.teacher_workers)
        )
        self.worker_tls()  # a CA file that does not load is refused here, not at a turn
        if shared := set(self.workers) & set(self.teacher_workers):
            raise ValueError(
                f"a worker cannot be both a rollout worker and a teacher: {sorted(shared)}"
            )
        unknown = self.append_roles - KNOWN_ROLES
        if unknown or not self.append_roles:
            raise ValueError(f"append_roles must be a non-empty subset of {sorted(KNOWN_ROLES)}")
        object.__setattr__(
            self, "chat_template_kwargs", MappingProxyType(dict(self.chat_template_kwargs))
        )
        _positive("upstream_timeout_s", self.upstream_timeout_s)
        _positive("connect_timeout_s", self.connect_timeout_s)
        _positive("max_body_mb", self.max_body_mb)
        if self.max_answer_mb is not None:
            _positive("max_answer_mb", self.max_answer_mb)
        if self.max_session_mb is not None:
            _positive("max_session_mb", self.max_session_mb)
        _positive("circuit_open_s", self.circuit_open_s)
        _positive("health_interval_s", self.health_interval_s)
        _positive("health_timeout_s", self.health_timeout_s)
        for name in ("keep_closed_s", "keep_collected_s", "pause_wait_s", "shutdown_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        _positive("journal_fsync_interval_s", self.journal_fsync_interval_s)
        _positive("journal_retry_s", self.journal_retry_s)
        if self.session_ttl_s is not None:
            _positive("session_ttl_s", self.session_ttl_s)
        if self.journal_fsync not in {"always", "interval", "never"}:
            raise ValueError("journal_fsync must be always, interval or never")
        for name in ("api_key", "admin_api_key"):
            key = getattr(self, name)
            # A key a client cannot send in a header could never match.
            if key is not None and not (
                key and key.isascii() and key.isprintable() and key == key.strip()
            ):
                raise ValueError(f"{name} must be printable ASCII, not empty, not padded")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("admin_api_key must differ from api_key (each is one role's key)")
        if self.max_session_tokens is not None and self.max_session_tokens < 1:
            raise ValueError("max_session_tokens must be >= 1")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
        for name in (
            "upstream_max_connections",
            "cpu_threads",
            "demo_workers",
            "unhealthy_after",
            "healthy_after",
            "circuit_failures",
            "circuit_successes",
            "circuit_sessions",
            "max_sessions",
            "max_connections",
            "max_segments",
            "max_messages",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_rollback_turns < 0:
            raise ValueError("max_rollback_turns must be >= 0")
        if self.on_abort not in ON_ABORT:
            raise ValueError(f"on_abort must be one of {', '.join(ON_ABORT)}")
        if self.on_sampling_conflict not in ON_SAMPLING_CONFLICT:
            raise ValueError(
                f"on_sampling_conflict must be one of {', '.join(ON_SAMPLING_CONFLICT)}"
            )
        if self.max_continuations < 0:
            raise ValueError("max_continuations must be >= 0")
        if self.on_divergence not in ON_DIVERGENCE:
            raise ValueError(f"on_divergence must be one of {', '.join(ON_DIVERGENCE)}")
        if self.kv_sessions == "stream":
            raise ValueError(STREAM_REFUSED)
        if self.kv_sessions not in KV_MODES:
            raise ValueError(f"kv_sessions must be one of {', '.join(KV_MODES)}")
        # The engine's own checks, then its flags: ValueError names the fix.
        refuse_unserved(self, lambda name: _FIELDS[name].default)
        if self.default_priority is not None and not is_priority(self.default_priority):
            raise ValueError(PRIORITY_RANGE)
        if self.prompt_mode not in PROMPT_MODES:
            raise ValueError(f"prompt_mode must be one of {', '.join(PROMPT_MODES)}")
        for name in ("offload_threshold_kb", "parse_processes", "process_threshold_kb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError("context_length must be >= 1")
        # Without a worker to read, the engine and the tokenizer must be
        # named: workers then join at run time (POST /workers), as a
        # trainer's own servers do once it launched them (docs/trainers.md).
        if not self.demo and not self.workers and (self.engine == "auto" or not self.tokenizer):
            raise ValueError(
                "at least one worker URL is required (or demo mode); to start without "
                "workers and add them with POST /workers, name the engine and the tokenizer"
            )
        if (
            not self.session_header
            or not self.session_header.isascii()
            or any(c in self.session_header for c in ' \t:()<>@,;\\"/[]?={}')
        ):
            raise ValueError(f"session_header {self.session_header!r} is not a header name")
        model = self.upstream_model
        if not (model and model.isprintable() and model == model.strip()):
            raise ValueError("upstream_model must be printable, not empty, not padded")
        _check_fleet(self)
        if self.log_level.lower() not in {"debug", "info", "warning", "error"}:
            raise ValueError(f"unknown log level {self.log_level!r}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def max_session_bytes(self) -> int | None:
        return None if self.max_session_mb is None else int(self.max_session_mb * 1024 * 1024)

    @property
    def max_answer_bytes(self) -> int:
        default = _MAX_ANSWER_MB_EXPERTS if self.routed_experts else _MAX_ANSWER_MB
        return int((self.max_answer_mb or default) * 1024 * 1024)

    @property
    def sends_session_hints(self) -> bool:
        """--kv-sessions hint: each turn names its session to the worker."""
        return self.kv_sessions == KvMode.HINT.value

    @property
    def fixed_upstream_model(self) -> str | None:
        """The name `upstream_model` fixes, None for its keywords."""
        model = self.upstream_model
        return None if model in (UPSTREAM_MODEL_SERVED, UPSTREAM_MODEL_AGENT) else model

    @property
    def allowed_worker_hosts(self) -> WorkerHosts | None:
        """The parsed `worker_hosts` (ValueError if one is not a host)."""
        return None if self.worker_hosts is None else WorkerHosts.parse(self.worker_hosts)

    # -- each wing's options: the services never see Settings -----------------

    def worker_tls(self) -> ssl.SSLContext | None:
        """The TLS context `https` workers are verified with (`worker_ca`);
        None: the pool's default, certifi's bundle. Built on each call (at
        validation, then once by `create_app`): Settings keeps only the path,
        because its fields travel to fleet shards and Ray actors, and an
        SSLContext neither pickles nor goes on a command line."""
        if self.worker_ca is None:
            return None
        try:
            return ssl.create_default_context(cafile=self.worker_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"worker_ca: {self.worker_ca!r} does not load as PEM CA certificates: {exc}"
            ) from None

    def pool_options(
        self,
        dialect: WorkerDialect,
        *,
        expected_settings: Mapping[str, Any] = MappingProxyType({}),
        supplied_settings: frozenset[str] = frozenset(),
        admissible: Callable[[Mapping[str, Any]], str | None] | None = None,
        teachers: bool = False,
    ) -> PoolOptions:
        """The rollout pool's options, speaking `dialect` to workers that must
        run with `expected_settings` (the engine's, `engines.resolve`), or
        without those of `supplied_settings`, and pass `admissible` (for
        the settings start-up could not read); with
        `teachers`, the teacher pool's (the same, but no session hints:
        teachers hold no sessions, and serve a model of their own)."""
        return PoolOptions(
            placement=self.placement,
            allowed_worker_hosts=self.allowed_worker_hosts,
            health_interval_s=self.health_interval_s,
            health_timeout_s=self.health_timeout_s,
            unhealthy_after=self.unhealthy_after,
            healthy_after=self.healthy_after,
            circuit_failures=self.circuit_failures,
            circuit_successes=self.circuit_successes,
            circuit_open_s=self.circuit_open_s,
            circuit_sessions=self.circuit_sessions,
            worker_pause_wait_s=self.pause_wait_s,
            upstream_max_connections=self.upstream_max_connections,
            upstream_timeout_s=self.upstream_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            max_answer_bytes=self.max_answer_bytes,
            sends_session_hints=self.sends_session_hints and not teachers,
            fixed_upstream_model=None if teachers else self.fixed_upstream_model,
            dialect=dialect,
            expected_settings=MappingProxyType({} if teachers else dict(expected_settings)),
            supplied_settings=frozenset() if teachers else supplied_settings,
            admissible=None if teachers else admissible,
            label="teacher workers: " if teachers else "",
        )

    def turn_policy(
        self,
        in_place_roles: frozenset[str] = frozenset(),
        rendered_whole: frozenset[str | None] = frozenset(),
    ) -> TurnPolicy:
        """What the start-up template check found: `in_place_roles`, the
        roles it renders in place exactly (they join --append-roles), and
        `rendered_whole`, the templates whose appended messages depend on the
        history."""
        return TurnPolicy(
            append_roles=self.append_roles | in_place_roles,
            max_rollback_turns=self.max_rollback_turns,
            chat_template_kwargs=self.chat_template_kwargs,
            on_divergence=OnDivergence(self.on_divergence),
            prompt_mode=PromptMode(self.prompt_mode),
            rendered_whole=rendered_whole,
            max_segments=self.max_segments,
            max_session_tokens=self.max_session_tokens,
            default_priority=self.default_priority,
            routed_experts=self.routed_experts,
            on_abort=OnAbort(self.on_abort),
            max_continuations=self.max_continuations,
            on_sampling_conflict=OnSamplingConflict(self.on_sampling_conflict),
        )

    def turn_limits(self) -> TurnLimits:
        """What a session may keep and a request may carry beyond tokens."""
        return TurnLimits(max_session_bytes=self.max_session_bytes, max_messages=self.max_messages)

    def journal_options(self) -> JournalOptions | None:
        if self.journal is None:
            return None
        return JournalOptions(
            directory=Path(self.journal),
            fsync=self.journal_fsync,
            fsync_interval_s=self.journal_fsync_interval_s,
            retry_s=self.journal_retry_s,
        )

    @property
    def offload_threshold_bytes(self) -> int:
        return self.offload_threshold_kb * 1024

    @property
    def process_threshold_bytes(self) -> int:
        return self.process_threshold_kb * 1024


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _check_fleet(settings: Settings) -> None:
    fleet = tuple(url.rstrip("/") for url in settings.fleet)
    object.__setattr__(settings, "fleet", fleet)
    if settings.processes < 1:
        raise ValueError("processes must be >= 1")
    for url in fleet:
        if not url.startswith(("http://", "https://")) or "?" in url or "#" in url:
            raise ValueError(f"fleet URL {url!r} is not an http(s)://host:port[/path] URL")
    if len(set(fleet)) != len(fleet):
        raise ValueError("fleet URLs must be distinct")
    if settings.processes > 1:
        if fleet and len(fleet) != settings.processes:
            raise ValueError("with processes, give one fleet URL per process (or none)")
    elif fleet and not 0 <= settings.shard < len(fleet):
        raise ValueError(f"shard must be in 0..{len(fleet) - 1} (an index into fleet)")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
