"""One base URL for all rollouts (docs/api.md#one-base-url-for-all-rollouts).

The model routes at the server root, ``/v1/…``, are the session's own
``/sessions/{id}/v1/…`` for the session a request names: by the session
header (``--session-header``, default ``X-Session-ID``, as verifiers and
header-keyed routers send it), else by the session's own key (it carries its
session's id; the gate checks the key as on the session's routes). The HTTP
edge rewrites such a request's path before anything else sees it, so the
key check, the routes, the turn and every error are those of the session's
route: a root request is that request under another name.

With ``--auto-create-sessions`` a root request naming an id the server has
never held creates the session first (metadata from ``X-Session-Metadata``,
a JSON object). An id held by a closed, expired or collected session is not
created again: a late agent must not start an episode its trainer will
never collect.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from ..errors import InvalidRequest
from ..session.session import SESSION_ID
from ..session.store import SessionStore
from .auth import request_credential, session_of_key

__all__ = ["METADATA_HEADER", "SessionRouting"]

ROOT_MODEL_PREFIX = "/v1/"
METADATA_HEADER = "X-Session-Metadata"
_METADATA = METADATA_HEADER.lower().encode()


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for key, value in headers if key == name), None)


@dataclass(frozen=True, slots=True)
class SessionRouting:
    """Which session a root model request is for, and creating it if asked."""

    header: str  # the session header's name, as configured
    auto_create: bool
    store: SessionStore

    def route(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> tuple[str, str] | None:
        """For a root model path naming a session: that session's path and
        id (None otherwise: the path is served as it is). Raises
        `InvalidRequest` for a session header that is no session id."""
        if not path.startswith(ROOT_MODEL_PREFIX):
            return None
        session_id = self.session_named(headers)
        return None if session_id is None else (f"/sessions/{session_id}{path}", session_id)

    def session_named(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        headers = list(headers)
        raw = _header(headers, self.header.lower().encode())
        if raw is not None:
            session_id = raw.decode("latin-1").strip()
            if not SESSION_ID.fullmatch(session_id) or session_id in (".", ".."):
                raise InvalidRequest(
                    f"the {self.header} header must be a session id: 1 to 128 of "
                    "A-Z a-z 0-9 . _ : -",
                    param=self.header,
                )
            return session_id
        credential = request_credential(
            _header(headers, b"authorization") or b"", _header(headers, b"x-api-key") or b""
        )
        return None if credential is None else session_of_key(credential)

    async def ensure(self, session_id: str, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """With --auto-create-sessions, create `session_id` if the server never
        held it (module doc); else nothing (the route answers 404 for it)."""
        if not self.auto_create or self.store.registry.find(session_id) is not None:
            return
        # No await between the check and `create`'s registration: two requests
        # racing on one new id create it once, the second then finds it.
        await self.store.create(session_id, metadata=self._metadata(headers), ttl_s=None)

    def _metadata(self, headers: Iterable[tuple[bytes, bytes]]) -> dict[str, Any] | None:
        raw = _header(headers, _METADATA)
        if raw is None:
            return None
        try:
            metadata = orjson.loads(raw)
        except orjson.JSONDecodeError:
            metadata = None
        if not isinstance(metadata, dict):
            raise InvalidRequest(
                f"the {METADATA_HEADER} header must be a JSON object", param=METADATA_HEADER
            )
        return metadata
