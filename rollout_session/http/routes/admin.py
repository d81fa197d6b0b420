"""Operator routes: the worker pool at run time, pausing, metrics.

``GET /workers`` shows the pool, ``POST /workers {"url"}`` adds a worker,
checked at once (it takes sessions once it passed an admission check, and
one that answers but is another engine's worker, serves another model or
runs other launch settings is refused with the reason:
`engines/pool/health.py`),
``DELETE /workers?url=`` drains one (no new pins, in-flight turns finish) and
removes it — the drain completes even if the request's client goes away; its
sessions re-pin on their next turn. ``POST /admin/pause``
holds new turns (weight sync) and answers once in-flight turns are done
(``{"mode": "drain"}``, the default) or at once, their requests aborted at
the workers to be continued after resume (``{"mode": "abort"}``);
``POST /admin/resume`` (``{"weight_version"}`` optional: the version of
what is sampled from now on, where the engine names none) releases them.
``GET /metrics`` is Prometheus text.

Their strings are bounded: a worker URL at most `MAX_URL_CHARS` characters,
a weight version at most `MAX_WEIGHT_VERSION_CHARS` (it names the tokens of
every turn sampled under it: each turn record, in memory, the journal and
every export, carries it).
"""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from ...errors import InvalidRequest
from ...turn.pause import PauseMode
from ..context import ServerContext
from ..metrics import CONTENT_TYPE
from .sessions import json_response, read_json_object

__all__ = ["MAX_URL_CHARS", "MAX_WEIGHT_VERSION_CHARS", "register_admin_routes"]

# What a browser or proxy takes as a URL (RFC 9110 §4.1 recommends at least
# 8,000 octets; 2,048 is the common floor): far above a worker's base URL.
MAX_URL_CHARS = 2048
# A step number, a commit, a timestamp or a checkpoint path: far below.
MAX_WEIGHT_VERSION_CHARS = 256


def _url(url: object) -> str:
    """A worker URL as given (the pool checks its form): a string, bounded."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest("url must be an http(s)://host[:port][/path] string", param="url")
    if len(url) > MAX_URL_CHARS:
        raise InvalidRequest(
            f"url is {len(url)} characters long; a worker URL has at most {MAX_URL_CHARS}",
            param="url",
        )
    return url


def register_admin_routes(app: QuartTrio, ctx: ServerContext) -> None:
    @app.get("/workers")
    async def list_workers() -> Response:
        teachers = ctx.teachers.workers.values() if ctx.teachers is not None else ()
        return json_response(
            {
                "workers": [w.summary() for w in ctx.pool.workers.values()],
                # --teacher-worker: scoring only (docs/training.md#rescoring).
                "teachers": [w.summary() for w in teachers],
            }
        )

    @app.post("/workers")
    async def add_worker() -> Response:
        url = _url((await read_json_object(optional=False)).get("url"))
        return json_response((await ctx.pool.join(url)).summary(), status=201)

    @app.post("/admin/pause")
    async def pause() -> Response:
        raw = (await read_json_object(optional=True)).get("mode", PauseMode.DRAIN.value)
        try:
            mode = PauseMode(raw)
        except ValueError:
            raise InvalidRequest("mode must be drain or abort", param="mode") from None
        interrupted = await ctx.pause.pause(mode)
        return json_response(
            {
                "paused": True,
                "mode": mode.value,
                "inflight": ctx.pause.inflight,
                "interrupted": interrupted,
                "waiting": ctx.pause.waiting,
            }
        )

    @app.post("/admin/resume")
    async def resume() -> Response:
        version = (await read_json_object(optional=True)).get("weight_version")
        if version is not None and not (
            isinstance(version, str) and 0 < len(version) <= MAX_WEIGHT_VERSION_CHARS
        ):
            raise InvalidRequest(
                f"weight_version must be a string of 1 to {MAX_WEIGHT_VERSION_CHARS} characters",
                param="weight_version",
            )
        ctx.pause.resume(version)
        return json_response({"paused": False, "weight_version": ctx.pause.declared_version})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), content_type=CONTENT_TYPE)

    @app.delete("/workers")
    async def remove_worker() -> Response:
        url = request.args.get("url")
        if not url:
            raise InvalidRequest("the url query parameter is required", param="url")
        return json_response((await ctx.pool.remove(_url(url))).summary())
