"""A fleet: several independent session servers, sessions sharded by id.

Every shard is a plain session server that knows the fleet's URLs
(``--fleet``, the same list in the same order everywhere) and which one it
is (``--shard``). A session belongs to the shard that rendezvous hashing
of its id picks among those URLs: the same function `SessionClient` uses
(`client.rendezvous_owner`), so a trainer holding the list goes straight
to the owner, and a shard finds the owner without asking anyone. Shards
share no state and never agree on anything: each request is answered from
the URLs alone (docs/deploy.md#a-fleet).

Two parts, both behind the app's HTTP edge (`edge.HttpEdge`: the key is
checked first, and bodies are read by the edge's one reader):

- `Fleet.redirect`, asked by the edge for every request naming a session
  (``/sessions/{id}…``, and root ``/v1/…`` requests naming one): on a shard
  that does not own the id the answer is 307 to the owner, same path and
  query, fast routes included.
- `FleetRoutes`, an ASGI layer between the edge and Quart: ``POST
  /sessions`` on any shard creates the session on its owner (a missing id
  is drawn here, so that it is owned), ``?fleet=1`` on ``GET /health``,
  ``/workers``, ``/metrics`` and ``/sessions`` answers for the whole fleet,
  and worker membership and pausing (``POST``/``DELETE /workers``, ``POST
  /admin/pause``, ``/admin/resume``) apply to every shard unless
  ``?fleet=0``. It reaches the shards, itself included, over HTTP with the
  caller's own key.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

import httpx
import orjson
import trio
from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGISendCallable,
    HTTPScope,
    Scope,
)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ..client import rendezvous_owner
from ..config import Settings
from ..errors import InternalError, InvalidRequest, RolloutSessionError, ShardUnavailable
from ..session.session import Session
from .edge import (
    RawResponse,
    error_response,
    replay,
    route_path,
    send_response,
)
from .metrics import CONTENT_TYPE

__all__ = ["Fleet", "FleetRoutes", "own_url"]

logger = logging.getLogger("rollout_session")

_JSON = b"application/json"
# Headers a fan-out request carries on: the caller's key and its body's type.
_FORWARDED = (b"authorization", b"x-api-key", b"content-type")
# Requests that change every shard unless ``?fleet=0``.
_BROADCAST = frozenset(
    {
        ("POST", "/workers"),
        ("DELETE", "/workers"),
        ("POST", "/admin/pause"),
        ("POST", "/admin/resume"),
    }
)
# Marks a create one shard forwarded to the owner it computed.
_FORWARDED_BY = b"x-rollout-fleet-forwarded-by"
_AGGREGATED = frozenset({"/health", "/workers", "/metrics", "/sessions"})
# What a path keeps unquoted in a Location (RFC 3986's pchar and "/").
_PATH_SAFE = "/:@!$&'()*+,;=-._~"
# Past the upstream timeout, for a shard's own answer to a change to arrive.
_MARGIN_S = 30.0


@dataclass(frozen=True, slots=True)
class Fleet:
    """The fleet's URLs and this server's place in it."""

    urls: tuple[str, ...]
    shard: int

    @classmethod
    def of(cls, settings: Settings) -> Fleet | None:
        return cls(settings.fleet, settings.shard) if settings.fleet else None

    @property
    def url(self) -> str:
        return self.urls[self.shard]

    def owner(self, session_id: str) -> str:
        return rendezvous_owner(self.urls, session_id)

    def owns(self, session_id: str) -> bool:
        return self.owner(session_id) == self.url

    def redirect(self, session_id: str, path: str, query: bytes) -> RawResponse | None:
        """307 to the shard that owns `session_id`, same path and query; None
        when this shard owns it. The HTTP edge asks, once it has checked the
        key and before it reads the body."""
        owner = self.owner(session_id)
        if owner == self.url:
            return None
        location = owner + quote(path, safe=_PATH_SAFE)
        if query:
            location += "?" + query.decode("latin-1")
        body = {"session_id": session_id, "location": location}
        return _json(307, body, [(b"location", location.encode())])


def own_url(settings: Settings) -> str:
    """This server's URL in its fleet; "" for a server on its own (its
    session URLs are then relative to wherever the client reached it)."""
    return settings.fleet[settings.shard] if settings.fleet else ""


def _flag(scope: HTTPScope, default: bool) -> bool:
    """The request's ``fleet`` query parameter (1/true/yes or 0/false/no)."""
    for key, value in parse_qsl(scope["query_string"].decode("latin-1")):
        if key == "fleet":
            return value.lower() in {"1", "true", "yes"}
    return default


def _header(scope: HTTPScope, name: bytes) -> bytes:
    return next((value for key, value in scope["headers"] if key == name), b"")


def _json(status: int, data: Any, headers: Sequence[tuple[bytes, bytes]] = ()) -> RawResponse:
    return RawResponse(status, [(b"content-type", _JSON), *headers], orjson.dumps(data))


Handler = Callable[[HTTPScope, bytes, ASGIReceiveCallable], Awaitable[RawResponse | None]]


class FleetRoutes:
    """ASGI middleware inside the HTTP edge, around Quart: creates on the
    owner, fleet-wide reads and changes (module doc). Reaches the shards
    with `http` (owned by the app: opened and closed with it)."""

    def __init__(
        self,
        app: ASGIFramework,
        fleet: Fleet,
        settings: Settings,
        registry: Iterable[Session] = (),
    ) -> None:
        self._app = app
        self._fleet = fleet
        self._registry = registry
        self.http: httpx.AsyncClient | None = None
        # Changes may wait for in-flight turns (pause, drain), which the
        # upstream timeout bounds; a shard that does not connect is down.
        self._timeout = httpx.Timeout(
            settings.upstream_timeout_s + _MARGIN_S, connect=settings.connect_timeout_s
        )

    async def open(self) -> None:
        self.http = httpx.AsyncClient(timeout=self._timeout)
        # The journal was replayed before start-up: sessions it restored
        # that another shard owns are out of every client's reach.
        misplaced = [s.id for s in self._registry if not self._fleet.owns(s.id)]
        if misplaced:
            logger.warning(
                "%d restored sessions (e.g. %s) belong to another shard by this fleet's "
                "URLs: the fleet's URLs or size changed since they were journaled, and "
                "requests for them are redirected to a shard that does not hold them. "
                "Start the fleet with the URLs it had (docs/deploy.md#a-fleet)",
                len(misplaced),
                ", ".join(misplaced[:3]),
            )

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path, method = route_path(scope), scope["method"]
        handler: Handler | None = None
        if method == "POST" and path == "/sessions":
            handler = self._create
        elif method == "GET" and path in _AGGREGATED and _flag(scope, default=False):
            handler = self._aggregate
        elif (method, path) in _BROADCAST and _flag(scope, default=True):
            handler = self._broadcast
        if handler is None:
            await self._app(scope, receive, send)
            return
        body = await _body(receive)  # the edge read it whole: one message
        try:
            response = await handler(scope, body, receive)
        except RolloutSessionError as exc:
            response = error_response(exc)
        if response is None:  # served here after all
            await self._app(scope, replay(body, receive), send)
        else:
            await send_response(send, response)

    # -- creates --------------------------------------------------------------

    async def _create(
        self, scope: HTTPScope, body: bytes, receive: ASGIReceiveCallable
    ) -> RawResponse | None:
        try:
            data = orjson.loads(body) if body.strip() else {}
        except orjson.JSONDecodeError:
            return None  # the route refuses it
        if not isinstance(data, dict):
            return None  # the route refuses it
        if data.get("session_id") is None:
            # Drawn here, not by the store: it must be this fleet's to place.
            data["session_id"] = uuid.uuid4().hex
        session_id = data["session_id"]
        if not isinstance(session_id, str):
            return None
        owner = self._fleet.owner(session_id)
        if owner == self._fleet.url:
            return await self._local(scope, orjson.dumps(data), receive)
        if _header(scope, _FORWARDED_BY):
            # Sent here by a shard that names this one the owner: the two
            # hold different fleet lists. Forwarding again could loop.
            raise InternalError(
                f"fleet misconfigured: a shard forwarded session {session_id!r} here, but "
                f"this shard ({self._fleet.url}) hashes it to {owner}: every shard must "
                "have the same --fleet list, in the same order"
            )
        forwarded = orjson.dumps(data)
        status, _, answer = await self._send(
            owner, scope, query=b"", body=forwarded, extra=[(_FORWARDED_BY, self._fleet.url)]
        )
        return RawResponse(status, [(b"content-type", _JSON)], answer)

    async def _local(
        self, scope: HTTPScope, body: bytes, receive: ASGIReceiveCallable
    ) -> RawResponse:
        """`scope` with `body` through this shard's own routes."""
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        local: HTTPScope = {**scope, "headers": headers}
        sent: list[bytes] = []
        status, out_headers = 500, []

        async def capture(message: Any) -> None:
            nonlocal status, out_headers
            if message["type"] == "http.response.start":
                status, out_headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                sent.append(message.get("body", b""))

        await self._app(local, replay(body, receive), capture)
        kept = [(k, v) for k, v in out_headers if k.lower() != b"content-length"]
        return RawResponse(status, kept, b"".join(sent))

    # -- fan-out ----------------------------------------------------------------

    async def _send(
        self,
        shard: str,
        scope: HTTPScope,
        *,
        query: bytes,
        body: bytes,
        extra: Sequence[tuple[bytes, str]] = (),
    ) -> tuple[int, str, bytes]:
        """`scope`'s request, with `query` and `body`, to `shard`: (status,
        content type, body). Raises `ShardUnavailable` if it does not answer."""
        assert self.http is not None, "the fleet client opens with the app"
        headers = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _FORWARDED
        }
        headers.update((k.decode("latin-1"), v) for k, v in extra)
        url = f"{shard}{route_path(scope)}" + (f"?{query.decode('latin-1')}" if query else "")
        try:
            response = await self.http.request(scope["method"], url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise ShardUnavailable(f"fleet shard {shard} did not answer: {exc!r}") from None
        return response.status_code, response.headers.get("content-type", ""), response.content

    async def _each(
        self, scope: HTTPScope, query: bytes, body: bytes
    ) -> list[tuple[int, str, bytes] | ShardUnavailable]:
        """`scope`'s request to every shard at once, in fleet order."""
        results: list[tuple[int, str, bytes] | ShardUnavailable] = [
            ShardUnavailable("not asked")
        ] * len(self._fleet.urls)

        async def one(i: int, shard: str) -> None:
            try:
                results[i] = await self._send(shard, scope, query=query, body=body)
            except ShardUnavailable as exc:
                results[i] = exc

        async with trio.open_nursery() as nursery:
            for i, shard in enumerate(self._fleet.urls):
                nursery.start_soon(one, i, shard)
        return results

    async def _broadcast(
        self, scope: HTTPScope, body: bytes, receive: ASGIReceiveCallable
    ) -> RawResponse:
        """The change on every shard; this shard's answer, with each shard's
        status under ``fleet``. Refused here (a wrong key, a bad URL) means
        refused everywhere: that answer is returned as it is."""
        results = await self._each(scope, _with_query(scope, fleet="0"), body)
        mine = results[self._fleet.shard]
        if isinstance(mine, ShardUnavailable):
            raise mine
        status, _, answer = mine
        data = orjson.loads(answer) if answer else {}
        if status >= 400 or not isinstance(data, dict):
            return RawResponse(status, [(b"content-type", _JSON)], answer)
        pairs = zip(self._fleet.urls, results, strict=True)
        data["fleet"] = [_shard_status(url, result) for url, result in pairs]
        return _json(status, data)

    async def _aggregate(
        self, scope: HTTPScope, body: bytes, receive: ASGIReceiveCallable
    ) -> RawResponse:
        path = route_path(scope)
        if path == "/sessions":
            return await self._sessions(scope)
        results = await self._each(scope, _with_query(scope, fleet=None), body)
        mine = results[self._fleet.shard]
        if isinstance(mine, ShardUnavailable):
            raise mine
        if mine[0] >= 400:  # e.g. 401: the same everywhere
            return RawResponse(mine[0], [(b"content-type", _JSON)], mine[2])
        pairs = list(zip(self._fleet.urls, results, strict=True))
        if path == "/metrics":
            return RawResponse(200, [(b"content-type", CONTENT_TYPE.encode())], _metrics(pairs))
        shards = [_shard_document(url, r) for url, r in pairs]
        if path == "/health":
            healthy = all(s.get("status") == "ok" for s in shards)
            total = sum(int(s.get("sessions", 0)) for s in shards)
            health = {"status": "ok" if healthy else "degraded", "sessions": total}
            return _json(200, {**health, "shards": shards})
        return _json(200, {"shards": shards})

    async def _sessions(self, scope: HTTPScope) -> RawResponse:
        """One page of every shard's sessions: shard after shard in fleet
        order, each in its own order; the cursor ``after`` (a session id)
        names its shard by its owner. A page can come back empty at the end."""
        params = dict(parse_qsl(scope["query_string"].decode("latin-1")))
        params.pop("fleet", None)
        raw_limit = params.get("limit", "100")
        if not raw_limit.isdigit() or int(raw_limit) < 1:
            raise InvalidRequest("limit must be a positive integer", param="limit")
        remaining = int(raw_limit)
        after = params.pop("after", None)
        start = self._fleet.urls.index(self._fleet.owner(after)) if after else 0
        sessions: list[Any] = []
        has_more = False
        for i in range(start, len(self._fleet.urls)):
            if remaining == 0:
                has_more = True
                break
            query = {**params, "limit": str(remaining)}
            if i == start and after:
                query["after"] = after
            status, _, answer = await self._send(
                self._fleet.urls[i], scope, query=urlencode(query).encode(), body=b""
            )
            if status != 200:
                return RawResponse(status, [(b"content-type", _JSON)], answer)
            page = orjson.loads(answer)
            sessions += page["sessions"]
            remaining -= len(page["sessions"])
            if page["has_more"]:
                has_more = True
                break
        return _json(200, {"sessions": sessions, "has_more": has_more})


def _with_query(scope: HTTPScope, *, fleet: str | None) -> bytes:
    """The request's query with ``fleet`` set to `fleet` (None: dropped)."""
    pairs = [(k, v) for k, v in parse_qsl(scope["query_string"].decode("latin-1")) if k != "fleet"]
    if fleet is not None:
        pairs.append(("fleet", fleet))
    return urlencode(pairs).encode()


def _shard_status(url: str, result: tuple[int, str, bytes] | ShardUnavailable) -> dict[str, Any]:
    if isinstance(result, ShardUnavailable):
        return {"url": url, "status": 503, "error": result.message}
    status, _, answer = result
    out: dict[str, Any] = {"url": url, "status": status}
    if status >= 400:
        out["error"] = orjson.loads(answer).get("error") if answer else None
    return out


def _shard_document(url: str, result: tuple[int, str, bytes] | ShardUnavailable) -> dict[str, Any]:
    """A shard's answer as an object with its URL; an unreachable one's
    ``status`` is ``unreachable``."""
    if isinstance(result, ShardUnavailable):
        return {"url": url, "status": "unreachable", "error": result.message}
    status, _, answer = result
    data = orjson.loads(answer) if answer else {}
    if status >= 400 or not isinstance(data, dict):
        return {"url": url, "status": "error", "error": data}
    return {"url": url, **data}


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _metrics(pairs: list[tuple[str, tuple[int, str, bytes] | ShardUnavailable]]) -> bytes:
    """Every shard's metrics, each sample labelled with its ``shard`` URL,
    each family once (the text format wants a family's samples together)."""
    merged: dict[str, Metric] = {}
    for url, result in pairs:
        if isinstance(result, ShardUnavailable) or result[0] != 200:
            continue
        for family in text_string_to_metric_families(result[2].decode()):
            into = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            for sample in family.samples:
                labels = {"shard": url, **sample.labels}
                into.samples.append(sample._replace(labels=labels))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    out: bytes = generate_latest(registry)
    return out


async def _body(receive: ASGIReceiveCallable) -> bytes:
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)
