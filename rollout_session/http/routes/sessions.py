"""HTTP routes (docs/api.md#errors): thin adapters from Quart requests to the context.

Handlers parse the request, call into sessions/turns/export and build the
response; they hold no state of their own. The HTTP edge (`http/edge.py`) has
checked the API key and the method and read the whole body before one runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import orjson
from quart import Response, request
from quart_trio import QuartTrio

from ...engines.kv_sessions import PRIORITY_RANGE, is_priority
from ...errors import InvalidRequest, JournalUnavailable, SessionTooLarge
from ...export.document import ExportQuery, ExportStatus, parse_query, serialize, view_document
from ...export.rescores import rescore_document
from ...session.session import Session, SessionState, json_bytes
from ...turn.request import parse_json_object
from ...turn.rescore import parse_rescore
from ...turn.sampling import parse_sampling
from ..auth import SessionKeys
from ..context import ServerContext
from ..fleet import own_url

__all__ = ["register_routes"]

_MAX_PAGE = 1000


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status=status, content_type="application/json")


async def document_response(ctx: ServerContext, doc: dict[str, Any], num_tokens: int) -> Response:
    # ~20 bytes of JSON per token: decide on the thread hop by that size.
    body = await ctx.offload.run(num_tokens * 20, serialize, doc)
    return Response(body, content_type="application/json")


async def read_body() -> bytes:
    # Complete already: the HTTP edge read it (within its limit) before Quart.
    data: bytes = await request.get_data(cache=False, as_text=False, parse_form_data=False)
    return data


async def read_json_object(*, optional: bool) -> dict[str, Any]:
    body = await read_body()
    if optional and not body.strip():
        return {}
    return parse_json_object(body)


@dataclass(frozen=True, slots=True)
class _CreateArgs:
    session_id: str | None
    metadata: dict[str, Any] | None
    ttl_s: float | None
    priority: int | None
    sampling: dict[str, Any] | None


def _create_args(body: dict[str, Any]) -> _CreateArgs:
    session_id = body.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise InvalidRequest("session_id must be a string", param="session_id")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object", param="metadata")
    ttl_s = body.get("ttl_s")
    if ttl_s is not None and (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, int | float)
        or not math.isfinite(ttl_s)
        or ttl_s <= 0
    ):
        raise InvalidRequest("ttl_s must be a positive number", param="ttl_s")
    priority = body.get("priority")
    if priority is not None and not is_priority(priority):
        raise InvalidRequest(f"{PRIORITY_RANGE} or null", param="priority")
    return _CreateArgs(session_id, metadata, ttl_s, priority, parse_sampling(body.get("sampling")))


_STATUS: dict[SessionState, ExportStatus] = {
    SessionState.EXPIRED: "expired",
    SessionState.COLLECTED: "closed",
}


def _page_args(args: Any) -> tuple[SessionState | None, int, str | None]:
    state_name = args.get("state")
    try:
        state = SessionState(state_name) if state_name else None
    except ValueError:
        names = [s.value for s in SessionState]
        raise InvalidRequest(f"state must be one of {names}", param="state") from None
    raw_limit = args.get("limit", "100")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= _MAX_PAGE:
        raise InvalidRequest(f"limit must be an integer in [1, {_MAX_PAGE}]", param="limit")
    return state, int(raw_limit), args.get("after")


def register_routes(app: QuartTrio, ctx: ServerContext) -> None:
    store = ctx.store
    registry = store.registry
    session_keys = SessionKeys.of(ctx.settings)
    base = own_url(ctx.settings)

    def session_key(session_id: str) -> str | None:
        return None if session_keys is None else session_keys.key(session_id)

    async def document(session: Session, status: ExportStatus, query: ExportQuery) -> Response:
        doc = view_document(
            session,
            query.view,
            status,
            query.include,
            ctx.ready_tokenizer.decode_pieces,
            schema=query.schema,
        )
        num_tokens = sum(len(s.trajectory) for s in session.segments())
        return await document_response(ctx, doc, num_tokens)

    def journal_state() -> str:
        if store.journal is None:
            return "off"
        return "ok" if store.writable else "unavailable"

    @app.get("/health")
    async def health() -> Response:
        healthy, total = ctx.pool.counts()
        journal = journal_state()
        return json_response(
            {
                # Alive either way (a restart would not help a full disk):
                # `degraded` while the journal cannot record changes.
                "status": "degraded" if journal == "unavailable" else "ok",
                "instance_id": ctx.instance_id,
                "workers": {"healthy": healthy, "total": total},
                "sessions": len(registry),
                "journal": journal,
            }
        )

    @app.get("/ready")
    async def ready() -> Response:
        # Ready = takes changes; replay is over before the listener opens.
        if not store.writable:
            raise JournalUnavailable(
                "not ready: the session journal cannot record changes now (a write failed); "
                "it retries by itself"
            )
        return json_response({"ready": True, "journal": journal_state()})

    @app.post("/sessions")
    async def create_session() -> Response:
        args = _create_args(await read_json_object(optional=True))
        budget = ctx.settings.max_session_bytes
        if budget is not None and json_bytes(args.metadata) > budget:
            # The metadata is kept with the session: the same budget.
            raise SessionTooLarge(
                f"metadata is {json_bytes(args.metadata)} bytes of JSON, over the "
                f"{budget} bytes of text a session keeps (--max-session-mb)",
                param="metadata",
            )
        session = await store.create(
            args.session_id,
            metadata=args.metadata,
            ttl_s=args.ttl_s,
            priority=args.priority,
            sampling=args.sampling,
        )
        return json_response(
            {
                "session_id": session.id,
                # Absolute in a fleet: on the shard that owns the id.
                "base_url": f"{base}/sessions/{session.id}/v1",
                # The agent's API key: it reaches this session's /v1 routes only.
                "api_key": session_key(session.id),
                "created_at": session.created_at,
            },
            status=201,
        )

    @app.get("/sessions")
    async def list_sessions() -> Response:
        state, limit, after = _page_args(request.args)
        page, has_more = registry.page(state=state, limit=limit, after=after)
        return json_response({"sessions": [s.summary() for s in page], "has_more": has_more})

    @app.get("/sessions/<session_id>")
    async def get_session(session_id: str) -> Response:
        # The key again: a trainer whose create answer was lost needs it.
        summary = registry.get(session_id).summary()
        return json_response({**summary, "api_key": session_key(session_id)})

    @app.get("/sessions/<session_id>/trajectory")
    async def get_trajectory(session_id: str) -> Response:
        query = parse_query(request.args)
        session = registry.get(session_id)
        return await document(session, _STATUS.get(session.state, "open"), query)

    @app.delete("/sessions/<session_id>")
    async def close_session(session_id: str) -> Response:
        query = parse_query(request.args)
        # Runs to the end even if this request is cancelled; only the answer
        # is lost, and a repeated DELETE gets the same document.
        session = await store.close(session_id)
        return await document(session, "closed", query)

    @app.post("/sessions/<session_id>/rescore")
    async def rescore(session_id: str) -> Response:
        args = parse_rescore(await read_json_object(optional=False))
        session = await ctx.rescorer.rescore(session_id, args)
        num_tokens = sum(len(s.trajectory) for s in session.segments())
        return await document_response(ctx, rescore_document(session, args.label), num_tokens)

    async def models() -> Response:
        # At once once a worker passed admission (the card is kept after);
        # 503 no_healthy_worker until then.
        info = await ctx.pool.model_info()
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": info.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "rollout-session",
                        "max_model_len": ctx.model.context_length,
                    }
                ],
            }
        )

    @app.get("/sessions/<session_id>/v1/models")
    async def list_models(session_id: str) -> Response:
        registry.get(session_id)
        return await models()

    @app.get("/v1/models")
    async def list_models_at_root() -> Response:
        """The served model, for a client at the root naming no session (a
        request naming one is that session's, session_routing.py)."""
        return await models()
