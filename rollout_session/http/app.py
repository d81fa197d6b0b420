"""The Quart-Trio application: `create_app(settings)`.

The app owns everything (session store, worker pool, tokenizer, turn runner)
via one `ServerContext` stored in ``app.extensions["rollout_session"]``.
Every request meets the HTTP edge first (`edge.HttpEdge`, wrapped around
Quart's ASGI callable): the API key, the body, unknown routes and methods,
the fast chat route. Quart's one error handler renders what its handlers
raise with the edge's `error_response`.
"""

from __future__ import annotations

import functools
import logging
import ssl
from types import TracebackType
from typing import cast

import httpx
import trio
from hypercorn.typing import ASGIFramework
from quart import Response
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers

from ..config import Settings
from ..engines.base import Engine
from ..engines.pool import WorkerPool
from ..engines.resolve import resolve_engine
from ..engines.served_model import ServedModel
from ..engines.spec import EngineParts, Launch
from ..errors import NoHealthyWorker, UpstreamError
from ..prompt.check import (
    Outcome,
    check_template,
    in_place_roles,
    reachable,
    rendered_whole,
    startup_refusal,
)
from ..prompt.tokenizer import ChatTokenizer, load_tokenizer
from ..session.expiry import Expiry
from ..session.session import SessionRegistry
from ..session.store import SessionStore
from ..turn.offload import Offload
from ..turn.pause import PauseGate
from ..turn.plan import TurnPolicy
from ..turn.request import count_items
from ..turn.rescore import Rescorer
from ..turn.runner import TurnRunner
from ..turn.validator import AnswerValidator
from .auth import Gate
from .context import EngineSide, ServerContext
from .edge import HttpEdge, error_response
from .fleet import Fleet, FleetRoutes
from .metrics import Metrics
from .protocols.chat import chat_route
from .protocols.messages import messages_routes
from .protocols.responses import responses_route
from .routes.admin import register_admin_routes
from .routes.inspector import is_public_path, register_inspector_routes
from .routes.sessions import register_routes
from .session_routing import SessionRouting

__all__ = ["StartRefused", "create_app", "server_context"]


class StartRefused(Exception):
    """The server cannot start as configured (a worker, the flags, the
    template); the message says why and the fix. Not a bug, so start-up
    logs no traceback for it (`serve` prints the message and exits 1)."""


logger = logging.getLogger("rollout_session")
_EXTENSION = "rollout_session"


def is_public(method: str, path: str) -> bool:
    """Requests served without the API key: ``/health`` and ``/ready``
    (load balancers, probes) and the inspector's page and assets, which hold
    no data (a browser loads them before anyone typed a key)."""
    return path in ("/health", "/ready") or (method in ("GET", "HEAD") and is_public_path(path))


def server_context(app: QuartTrio) -> ServerContext:
    ctx: ServerContext = app.extensions[_EXTENSION]
    return ctx


def create_app(
    settings: Settings,
    *,
    tokenizer: ChatTokenizer | None = None,
    worker_tls: ssl.SSLContext | None = None,
) -> QuartTrio:
    """Build the app. `tokenizer` skips loading one at startup (embedding,
    tests); `worker_tls` verifies ``https`` workers instead of the one
    `settings.worker_ca` gives (tests share one context across apps)."""
    # No static folder: the inspector serves its own assets (`routes/inspector.py`).
    app = QuartTrio("rollout_session", static_folder=None)
    # Quart's defaults (16 MiB body, 60 s response timeout) silently cut long
    # generations. The body's limit and timeout are the edge's: it has read
    # the whole body before Quart sees the request. Responses are never timed out.
    app.config.update(
        MAX_CONTENT_LENGTH=None,
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=None,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    # One TLS context for every worker client (building one loads the CA
    # bundle): the given one, --worker-ca's, else certifi's.
    tls = worker_tls or settings.worker_tls() or httpx.create_ssl_context(trust_env=False)
    offload = Offload(
        threshold_bytes=settings.offload_threshold_bytes, threads=settings.cpu_threads
    )
    # Where every worker answer's strict check runs (loop, thread, process).
    validator = AnswerValidator(
        offload,
        processes=settings.parse_processes,
        process_threshold_bytes=settings.process_threshold_bytes,
    )
    store = SessionStore(SessionRegistry(max_sessions=settings.max_sessions))
    ctx: ServerContext

    def engine_parts() -> tuple[WorkerPool, Engine] | None:
        side = ctx.engine_side
        return None if side is None else (side.pool, side.engine)

    async def interrupt() -> int:
        return await ctx.pool.interrupt()

    ctx = ServerContext(
        settings=settings,
        store=store,
        offload=offload,
        validator=validator,
        # Holds turns for a weight sync; aborts them at the engine's workers.
        pause=PauseGate(
            settings.pause_wait_s,
            interrupt=interrupt,
            resume_sending=lambda: ctx.pool.resume_sending(),
        ),
        metrics=Metrics(store, engine_parts),
        expiry=Expiry(
            store,
            default_ttl_s=settings.session_ttl_s,
            keep_closed_s=settings.keep_closed_s,
            keep_collected_s=settings.keep_collected_s,
        ),
        tokenizer=tokenizer,
    )
    app.extensions[_EXTENSION] = ctx

    @app.before_serving
    async def startup() -> None:
        # The engine first: the store's sessions (a journal's) are the
        # engine's to pin, and everything below speaks to its workers.
        ctx.engine_side = side = await _start_engine(settings, validator, store, tls)
        if settings.journal is not None:
            await ctx.store.open_journal(settings.journal_options())  # done under `serve`
            await app.nursery.start(ctx.store.run_journal)
        await app.nursery.start(side.pool.run)
        if side.teachers is not None:
            await app.nursery.start(side.teachers.run)
        await app.nursery.start(ctx.validator.run)
        app.nursery.start_soon(ctx.expiry.forever)
        tokenizer = await _load_model(ctx)
        await side.engine.prepare(tokenizer)
        policy = await _check_template(tokenizer, settings)
        ctx.turns = TurnRunner(
            store=ctx.store,
            pause=ctx.pause,
            engine=side.engine,
            offload=ctx.offload,
            metrics=ctx.metrics,
            tokenizer=tokenizer,
            model=side.model,
            policy=policy,
            limits=settings.turn_limits(),
        )

    quart_log_exception = app.log_exception

    def log_exception(
        exc_info: tuple[type, BaseException, TracebackType] | tuple[None, None, None],
    ) -> None:
        if not isinstance(exc_info[1], StartRefused):
            quart_log_exception(exc_info)

    app.log_exception = log_exception  # type: ignore[method-assign,assignment]

    @app.after_serving
    async def shutdown() -> None:
        side = ctx.engine_side
        if side is not None:
            await side.engine.close_worker_sessions(ctx.registry)
            await side.pool.aclose()
            if side.teachers is not None:
                await side.teachers.aclose()
        await ctx.store.aclose()

    # Also werkzeug's HTTPExceptions: Quart looks handlers up along the
    # exception's classes (its routing redirects never reach one).
    @app.errorhandler(Exception)
    async def on_error(error: Exception) -> Response:
        status, headers, body = error_response(error)
        pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        return Response(body, status=status, headers=Headers(pairs))

    register_routes(app, ctx)
    register_admin_routes(app, ctx)
    register_inspector_routes(app, ctx)
    gate = Gate.of(settings, is_public=is_public)
    sessions = SessionRouting(settings.session_header, settings.auto_create_sessions, ctx.store)
    fleet = Fleet.of(settings)
    inner: ASGIFramework = app.asgi_app
    if fleet is not None:  # a fleet's shard (fleet.py): its routes inside the edge
        inner = fleet_routes = FleetRoutes(inner, fleet, settings, ctx.store.registry)
        app.before_serving(fleet_routes.open)
        app.after_serving(fleet_routes.aclose)
    # Quart's documented middleware hook: wrap asgi_app, keep the app object.
    app.asgi_app = HttpEdge(  # type: ignore[method-assign]
        inner,
        routes=app.url_map.bind("localhost"),
        fast_routes=[chat_route(ctx), responses_route(ctx), *messages_routes(ctx)],
        authorize=gate.check if gate is not None else None,
        max_body_bytes=settings.max_body_bytes,
        # Counted before any protocol parses a model route's body.
        check_body=functools.partial(count_items, limit=settings.max_messages),
        sessions=sessions,
        redirect=fleet.redirect if fleet is not None else None,
    )
    return app


async def _start_engine(
    settings: Settings, validator: AnswerValidator, store: SessionStore, tls: ssl.SSLContext
) -> EngineSide:
    """The engine ``--engine`` names, chosen and set from what the workers say
    (`engines.resolve`: ``auto`` probes them), its pool (and the teachers'),
    attached to the store. ValueError (a refused start) names the reason."""
    try:
        resolved = await resolve_engine(
            settings,
            settings.workers,
            tls=tls,
            deadline_s=settings.connect_timeout_s + 3 * settings.health_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
        )
    except ValueError as refused:
        raise StartRefused(str(refused)) from None
    spec, launch = resolved.spec, resolved.launch
    chosen = cast(Settings, resolved.settings)
    if settings.engine != spec.name:
        logger.info(
            "engine %s (--engine %s), its workers running %s",
            spec.name,
            settings.engine,
            ", ".join(f"{k}={v}" for k, v in launch.items()) or "nothing it reads",
        )
    pool = WorkerPool(
        chosen.pool_options(
            spec.dialect,
            expected_settings=resolved.expected,
            supplied_settings=spec.supplied,
            admissible=resolved.admissible if resolved.unread else None,
        ),
        validator,
        tls=tls,
    )
    for url in settings.workers:
        pool.add(url)
    teachers = None
    if settings.teacher_workers:
        teachers = WorkerPool(chosen.pool_options(spec.dialect, teachers=True), validator, tls=tls)
        for url in settings.teacher_workers:
            teachers.add(url)
    model = ServedModel(pool, settings.context_length, settings.upstream_model)
    engine = spec.build(chosen, EngineParts(pool, model, Launch(launch, resolved.unread, pool)))
    store.attach(engine)
    rescorer = Rescorer(store.registry, pool, teachers, max_resends=settings.max_continuations)
    return EngineSide(spec, chosen, pool, engine, model, rescorer, teachers)


async def _load_model(ctx: ServerContext) -> ChatTokenizer:
    """Learn the served model and load the tokenizer before taking requests.

    Without --tokenizer the worker must answer (it names its tokenizer); with
    one, an unreachable worker only delays the model card until one passes
    admission.
    """
    settings = ctx.settings
    try:
        await ctx.pool.model_info()
    except (UpstreamError, NoHealthyWorker) as exc:
        if settings.tokenizer is None and ctx.tokenizer is None:
            raise StartRefused(str(exc)) from None
        logger.warning("worker model info unavailable at startup; continuing with --tokenizer")
    if ctx.tokenizer is None:
        info = ctx.model.info
        path = settings.tokenizer or (info.tokenizer_path if info else None)
        if not path:
            raise StartRefused("the worker reports no tokenizer_path; pass --tokenizer")
        try:
            ctx.tokenizer = await trio.to_thread.run_sync(
                load_tokenizer, path, settings.chat_template
            )
        except (OSError, ValueError) as exc:
            raise StartRefused(f"cannot load tokenizer {path!r} ({exc}); pass --tokenizer") from exc
        logger.info(
            "serving %s with tokenizer %s (vocab %d)",
            ctx.model.name or "unknown model",
            path,
            ctx.tokenizer.vocab_size,
        )
    return ctx.tokenizer


async def _check_template(tokenizer: ChatTokenizer, settings: Settings) -> TurnPolicy:
    """Refuse to start on a template the server would extend wrongly (or not
    at all, for a case the settings allow); log what it rewrites. Return the
    turns' policy with what the check found: the appended roles beyond
    --append-roles the template renders in place exactly (a session goes on
    through them: docs/api.md#history-rules), and the templates whose
    appended messages depend on the history, said with a warning
    (docs/templates.md#history-dependent-templates)."""
    results = await trio.to_thread.run_sync(
        check_template, tokenizer, settings.chat_template_kwargs
    )
    roles = settings.append_roles | in_place_roles(results)
    for result in results:
        if result.outcome is not Outcome.EXACT:
            # A case agents cannot send (its roles are not appendable) is detail.
            logger.log(
                logging.INFO if reachable(result, roles) else logging.DEBUG,
                "chat template%s, %s: %s: %s",
                "" if result.template is None else f" {result.template!r}",
                result.name,
                result.outcome.value,
                result.detail,
            )
    refusal = startup_refusal(results, settings.append_roles)
    if refusal is not None:
        # Its first line names the fix: the --append-roles that would start,
        # else --chat-template FILE.
        raise StartRefused(
            refusal + "\n(`rollout-session check-template` prints the whole report; "
            "docs/templates.md says what to do)"
        )
    whole = rendered_whole(results)
    for line in whole.values():
        logger.warning("%s", line)
    return settings.turn_policy(in_place_roles(results), frozenset(whole))
