"""Trainer-side client: create sessions, hand agents their base URL, collect.

`SessionClient` is async and works under asyncio and trio alike (httpx and
anyio support both). With several session servers it shards sessions by id
(docs/deploy.md#more-than-one-session-server): ids are generated
client-side, and rendezvous hashing maps each id to one server, so any
client process with the same server list finds a session without asking
anyone, and adding a server moves only ~1/N of them.

Retries are idempotent by construction: a create is retried with the same id
(a 409 ``session_exists`` after a lost answer means the first try worked); a
close is retried on any transport error, because the server keeps a
collected session readable for ``--keep-collected-s`` (600 s by default) and
answers a repeated DELETE with the same document. Only a retry that finds
the session gone (collected longer ago than that) raises `TrajectoryLost`,
rather than pretending.

Each `SessionHandle` carries what its agent needs: ``base_url`` and, on a
server with ``--api-key``, ``api_key``, the session's own key, which reaches
that session's model routes and nothing else (docs/security.md). Give the
agent those two, never the client's own key.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Literal, TypeVar

import anyio
import httpx
import orjson

# The export's `?format=` views (docs/training.md).
View = Literal["document", "sample", "steps"]
# The document's `?schema=`: 1 is v1's (the last segment's fields at the top
# level), 3 every segment once (the server's default).
Schema = Literal[1, 3]
T = TypeVar("T")

__all__ = [
    "SessionClient",
    "SessionHandle",
    "SessionServerError",
    "TrajectoryLost",
    "rendezvous_owner",
]


class SessionServerError(RuntimeError):
    """The session server answered with an error document."""

    def __init__(self, status_code: int, code: str, message: str) -> None:
        super().__init__(f"{status_code} {code}: {message}")
        self.status_code = status_code
        self.code = code


class TrajectoryLost(RuntimeError):
    """A close reached the server but its answer did not reach us, and the
    server no longer holds the collected session when asked again."""


@dataclass(frozen=True, slots=True)
class SessionHandle:
    session_id: str
    server: str
    # Give this to the agent as its OpenAI base_url.
    base_url: str
    # And this as its OpenAI api_key: the session's own key (None when the
    # server runs without --api-key: any string will do then).
    api_key: str | None = None


def _score(server: str, session_id: str) -> int:
    digest = hashlib.blake2b(f"{server}|{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_owner(servers: Sequence[str], session_id: str) -> str:
    """Rendezvous hashing: the server with the highest score owns the id
    (the session servers of a fleet ask the same: docs/deploy.md#a-fleet)."""
    return max(servers, key=lambda server: _score(server, session_id))


class SessionClient:
    def __init__(
        self,
        servers: Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if isinstance(servers, str):  # a str is a Sequence[str] of one-letter "URLs"
            raise TypeError(f"servers is a list of URLs: SessionClient([{servers!r}])")
        if not servers:
            raise ValueError("at least one session server URL is required")
        self.servers = tuple(s.rstrip("/") for s in servers)
        self._retries = retries
        self._backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(timeout=timeout_s, headers=headers, transport=transport)

    async def __aenter__(self) -> SessionClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def server_for(self, session_id: str) -> str:
        """Rendezvous hashing: the server with the highest score owns the id."""
        return rendezvous_owner(self.servers, session_id)

    def handle(self, session_id: str) -> SessionHandle:
        server = self.server_for(session_id)
        return SessionHandle(session_id, server, f"{server}/sessions/{session_id}/v1")

    async def _send(
        self,
        method: str,
        url: str,
        *,
        retry_on: tuple[type[Exception], ...] = (httpx.TransportError,),
        **kwargs: Any,
    ) -> tuple[httpx.Response, bool]:
        """Send, retrying on `retry_on` with backoff; also say whether it was retried."""
        attempt = 0
        while True:
            try:
                return await self._http.request(method, url, **kwargs), attempt > 0
            except retry_on:
                if attempt == self._retries:
                    raise
                await anyio.sleep(self._backoff_s * 2**attempt)
                attempt += 1

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.is_success:
            return
        try:
            error = orjson.loads(response.content)["error"]
            code, message = str(error["code"]), str(error["message"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            code, message = "unknown", response.text[:200]
        raise SessionServerError(response.status_code, code, message)

    async def create(
        self,
        session_id: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        ttl_s: float | None = None,
        priority: int | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> SessionHandle:
        """A new session on its shard. `sampling`: the trainer's, pinned for
        every turn whatever the agent sends (docs/api.md#pinned-sampling)."""
        handle = self.handle(session_id or uuid.uuid4().hex)
        body: dict[str, Any] = {"session_id": handle.session_id}
        if metadata is not None:
            body["metadata"] = metadata
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        if priority is not None:
            body["priority"] = priority  # SGLang's, for this session's turns
        if sampling is not None:
            body["sampling"] = sampling
        response, retried = await self._send("POST", f"{handle.server}/sessions", json=body)
        if retried and response.status_code == 409:
            # A retried create that finds its own id means the first one
            # landed; its answer, with the session's key, was lost: ask again.
            response, _ = await self._send("GET", f"{handle.server}/sessions/{handle.session_id}")
        self._raise_for(response)
        api_key = orjson.loads(response.content).get("api_key")
        return replace(handle, api_key=api_key if isinstance(api_key, str) else None)

    async def trajectory(
        self,
        session: str | SessionHandle,
        *,
        include: Sequence[str] | None = None,
        view: View = "document",
        schema: Schema | None = None,
    ) -> dict[str, Any]:
        """The trajectory so far, without closing; `session` is the handle
        `create` returned or its id. `view`: the whole ``document``, one
        ``sample`` per segment, or one record per turn (``steps``).
        `schema` (documents only): ``1`` for v1's document, the last
        segment's fields at the top level; None (the server's default, 3):
        every segment under ``segments``."""
        session_id = _id_of(session)
        server = self.server_for(session_id)
        response, _ = await self._send(
            "GET",
            f"{server}/sessions/{session_id}/trajectory",
            params=_params(include, view, schema),
        )
        self._raise_for(response)
        doc: dict[str, Any] = orjson.loads(response.content)
        return doc

    async def close(
        self,
        session: str | SessionHandle,
        *,
        include: Sequence[str] | None = None,
        view: View = "document",
        schema: Schema | None = None,
    ) -> dict[str, Any]:
        """Collect the final trajectory (status ``closed``); `session` is the
        handle `create` returned or its id, `include`, `view` and `schema` as
        for `trajectory`. Retried on a lost answer: the server answers a repeated
        DELETE with the same document for ``--keep-collected-s``, then
        forgets the session."""
        session_id = _id_of(session)
        url = f"{self.server_for(session_id)}/sessions/{session_id}"
        response, retried = await self._send("DELETE", url, params=_params(include, view, schema))
        if retried and response.status_code == 404:
            # The first try may have collected it, and the server forgot it since.
            raise TrajectoryLost(
                f"close of {session_id} was retried after a lost answer, and the server "
                "no longer holds the session (collected longer than --keep-collected-s "
                "ago, or never there)"
            )
        self._raise_for(response)
        doc: dict[str, Any] = orjson.loads(response.content)
        return doc

    async def rescore(
        self,
        session: str | SessionHandle,
        target: str,
        label: str,
        *,
        positions: Literal["sampled", "all"] = "sampled",
    ) -> dict[str, Any]:
        """The logprobs of exactly the session's tokens under `target`
        (``"pinned"``: the session's own worker; ``"teacher"``: a
        ``--teacher-worker``; or a worker's URL), stored as
        ``rescores[label]`` of every segment and returned
        (docs/training.md#rescoring). Retried on a lost answer (a rescore
        repeated replaces itself). For many sessions, run several at once:
        each is one prefill-only request per segment."""
        session_id = _id_of(session)
        url = f"{self.server_for(session_id)}/sessions/{session_id}/rescore"
        body = {"target": target, "label": label, "positions": positions}
        response, _ = await self._send("POST", url, json=body)
        self._raise_for(response)
        doc: dict[str, Any] = orjson.loads(response.content)
        return doc

    async def rescore_all(
        self,
        sessions: Sequence[str | SessionHandle],
        target: str,
        label: str,
        *,
        positions: Literal["sampled", "all"] = "sampled",
        concurrency: int = 8,
    ) -> list[dict[str, Any]]:
        """`rescore` every session, `concurrency` at a time; the answers in
        the order of `sessions`. The first failure cancels the rest and
        rises (rescores already done stay stored: each is whole)."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        answers: list[dict[str, Any]] = [{} for _ in sessions]
        limit = anyio.CapacityLimiter(concurrency)

        async def one(i: int, session: str | SessionHandle) -> None:
            async with limit:
                answers[i] = await self.rescore(session, target, label, positions=positions)

        async with anyio.create_task_group() as group:
            for i, session in enumerate(sessions):
                group.start_soon(one, i, session)
        return answers

    async def pause(
        self, mode: Literal["drain", "abort"] = "drain", *, api_key: str | None = None
    ) -> list[dict[str, Any]]:
        """Pause every server for a weight update, concurrently; their
        answers in `servers` order. ``drain`` returns once no turn is at a
        worker; ``abort`` at once, the turns at workers interrupted, to be
        continued on `resume`. `api_key`: the operator key, if the servers
        have one (else the client's key is sent)."""
        return await self._admin("/admin/pause", {"mode": mode}, api_key)

    async def resume(
        self, weight_version: str | None = None, *, api_key: str | None = None
    ) -> list[dict[str, Any]]:
        """Resume every server; `weight_version` names what is sampled from
        now on where the engine names no version."""
        body = {} if weight_version is None else {"weight_version": weight_version}
        return await self._admin("/admin/resume", body, api_key)

    async def workers(self, *, api_key: str | None = None) -> list[dict[str, Any]]:
        """Each server's ``GET /workers`` answer, in `servers` order."""
        headers = _bearer(api_key)

        async def one(server: str) -> dict[str, Any]:
            response, _ = await self._send("GET", server + "/workers", headers=headers)
            self._raise_for(response)
            listed: dict[str, Any] = orjson.loads(response.content)
            return listed

        return await self._each(one)

    async def add_worker(self, url: str, *, api_key: str | None = None) -> list[dict[str, Any]]:
        """Add the worker at `url` to every server's pool (``POST /workers``);
        each server's answer: the worker, or, where it already had it, the
        worker as ``GET /workers`` lists it (a retried add that landed is
        not an error). A worker a server refuses raises `SessionServerError`."""
        headers = _bearer(api_key)

        async def one(server: str) -> dict[str, Any]:
            response, _ = await self._send(
                "POST", server + "/workers", json={"url": url}, headers=headers
            )
            if response.status_code == 409:  # worker_exists
                listed, _ = await self._send("GET", server + "/workers", headers=headers)
                self._raise_for(listed)
                pool = orjson.loads(listed.content)["workers"]
                found: dict[str, Any] = next(
                    (w for w in pool if w["url"] == url.rstrip("/")), {"url": url}
                )
                return found
            self._raise_for(response)
            added: dict[str, Any] = orjson.loads(response.content)
            return added

        return await self._each(one)

    async def remove_worker(self, url: str, *, api_key: str | None = None) -> None:
        """Drain and remove the worker at `url` from every server that has it
        (``DELETE /workers``; a server without it is left as it is)."""
        headers = _bearer(api_key)

        async def one(server: str) -> None:
            response, _ = await self._send(
                "DELETE", server + "/workers", params={"url": url}, headers=headers
            )
            if response.status_code != 404:  # worker_not_found: nothing to remove
                self._raise_for(response)

        await self._each(one)

    async def _admin(
        self, path: str, body: dict[str, Any], api_key: str | None
    ) -> list[dict[str, Any]]:
        headers = _bearer(api_key)

        async def one(server: str) -> dict[str, Any]:
            response, _ = await self._send("POST", server + path, json=body, headers=headers)
            self._raise_for(response)
            answer: dict[str, Any] = orjson.loads(response.content)
            return answer

        return await self._each(one)

    async def _each(self, call: Callable[[str], Awaitable[T]]) -> list[T]:
        """`call` for every server at once; the results in `servers` order."""
        results: dict[int, T] = {}

        async def one(i: int, server: str) -> None:
            results[i] = await call(server)

        async with anyio.create_task_group() as group:
            for i, server in enumerate(self.servers):
                group.start_soon(one, i, server)
        return [results[i] for i in range(len(self.servers))]


def _bearer(api_key: str | None) -> dict[str, str] | None:
    """The operator key's header, when one is given (else the client's is sent)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


def _params(include: Sequence[str] | None, view: View, schema: Schema | None) -> dict[str, str]:
    params: dict[str, str] = {"format": view}
    if include is not None:
        params["include"] = ",".join(include)
    if schema is not None:
        params["schema"] = str(schema)
    return params


def _id_of(session: str | SessionHandle) -> str:
    return session.session_id if isinstance(session, SessionHandle) else session
