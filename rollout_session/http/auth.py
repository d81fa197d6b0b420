"""Who may call which route: the roles, their keys, and the sessions' own keys.

Three keys, one per role (docs/security.md has the table):

- **a session's key** (``api_key`` in the answer to ``POST /sessions``)
  reaches that session's model routes, ``/sessions/{id}/v1/…``, and nothing
  else: it is what an agent's SDK sends as its API key;
- **the trainer's key** (``--api-key``) reaches every route but the
  operator's: sessions, their trajectories, and any session's model routes;
- **the operator's key** (``--admin-api-key``) reaches every route: the
  worker pool, pause and resume, ``/metrics``, and the rest.

Without ``--admin-api-key`` the trainer's key is also the operator's (one
key, as before roles existed); without ``--api-key`` no route but the
operator's needs a key, and sessions have no key of their own.

A session's key is derived, never stored: ``rs-<id>.<mac>``, the MAC being
HMAC-SHA256 of the session id under a secret that is itself derived from
``--api-key``. So a restart on the same key and journal gives every session
the key it had, the server keeps no secret per session, and changing
``--api-key`` revokes every session's key. The key is bound to the id: a
session created again under an id that was used before gets the same key.
The id in the key (ids are not secret: they are in every URL) lets the root
model routes find the session from the key alone (`session_of_key`); the MAC
is what proves it.

Keys are compared in constant time (`hmac.compare_digest`). The header's
scheme is case-insensitive (RFC 9110 §11.1): ``bearer KEY`` is accepted. A
key may also come as ``x-api-key: KEY``, the header Anthropic's SDKs (and
Claude Code) send; ``Authorization`` wins when a request carries both.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
from collections.abc import Callable

from ..config import Settings
from ..errors import PermissionDenied, Unauthorized

__all__ = [
    "Access",
    "Gate",
    "SessionKeys",
    "access_of",
    "bearer_credential",
    "request_credential",
    "session_of_key",
]

_SESSIONS = "/sessions/"
_MODEL_ROUTES = "/v1/"
_OPERATOR_PATHS = ("/workers", "/admin", "/metrics")
# Fixed: it names what the secret is for, so the same --api-key never keys
# anything else the same way. Changing it would revoke every session's key.
_SESSION_KEY_LABEL = b"rollout-session session key v1"
_SESSION_KEY_PREFIX = "rs-"
# Between the id and the MAC: never in a MAC (base64url), last in the key.
_SESSION_KEY_SEPARATOR = "."
_UNAUTHORIZED = "missing or wrong API key (Authorization: Bearer <key>, or x-api-key: <key>)"
_WRONG_SESSION = (
    "missing or wrong API key (Authorization: Bearer <key>, or x-api-key: <key>); "
    "a session's key reaches only that session's /v1 routes"
)


class Access(enum.Enum):
    """What a request needs, by its route."""

    # No key: /health and /ready (probes, load balancers) and the inspector's page and
    # files, which hold no data (a browser loads them before a key is typed).
    PUBLIC = "public"
    # A session's model routes (/sessions/{id}/v1/…): that session's key, the
    # trainer's or the operator's.
    MODEL = "model"
    # Everything else a trainer does (sessions, trajectories, the inspector's
    # data): the trainer's key or the operator's.
    TRAINER = "trainer"
    # The worker pool, pause and resume, metrics: the operator's key (the
    # trainer's when there is no operator key).
    OPERATOR = "operator"


def access_of(
    method: str, path: str | None, is_public: Callable[[str, str], bool]
) -> tuple[Access, str | None]:
    """The access a request needs (`path` None: outside the ASGI root path,
    matching no route), and for a model route the session id in its path.
    `is_public` (method, path) names the public requests."""
    if path is None:
        return Access.TRAINER, None
    if is_public(method, path):
        return Access.PUBLIC, None
    if path.startswith(_SESSIONS):
        session_id, slash, rest = path[len(_SESSIONS) :].partition("/")
        if session_id and slash and f"/{rest}".startswith(_MODEL_ROUTES):
            return Access.MODEL, session_id
        return Access.TRAINER, None
    for prefix in _OPERATOR_PATHS:
        if path == prefix or path.startswith(prefix + "/"):
            return Access.OPERATOR, None
    return Access.TRAINER, None


def bearer_credential(authorization: bytes) -> bytes | None:
    """The credential of an ``Authorization: Bearer <credential>`` header
    value; None for another scheme or none. The scheme is case-insensitive."""
    scheme, _, credential = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return credential.lstrip(b" ") or None


def request_credential(authorization: bytes, api_key: bytes) -> bytes | None:
    """A request's key: the ``Authorization: Bearer`` credential, else the
    ``x-api-key`` header's value (headers' values, b"" when absent)."""
    return bearer_credential(authorization) or api_key.strip(b" ") or None


class SessionKeys:
    """Each session's own key, derived from the trainer's key."""

    def __init__(self, api_key: str) -> None:
        secret = hmac.new(api_key.encode(), _SESSION_KEY_LABEL, hashlib.sha256).digest()
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)

    @classmethod
    def of(cls, settings: Settings) -> SessionKeys | None:
        """None without ``--api-key``: sessions then have no key of their own."""
        return None if settings.api_key is None else cls(settings.api_key)

    def key(self, session_id: str) -> str:
        mac = self._mac.copy()
        mac.update(session_id.encode())
        digest = base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()
        return f"{_SESSION_KEY_PREFIX}{session_id}{_SESSION_KEY_SEPARATOR}{digest}"


def session_of_key(credential: bytes) -> str | None:
    """The session a session's key names (not checked: the gate checks the
    key against that session's routes), or None for any other credential."""
    text = credential.decode("latin-1")
    if not text.startswith(_SESSION_KEY_PREFIX):
        return None
    session_id, separator, _ = text[len(_SESSION_KEY_PREFIX) :].rpartition(_SESSION_KEY_SEPARATOR)
    return session_id if separator and session_id else None


class Gate:
    """The key check for every request, for the HTTP edge."""

    def __init__(self, settings: Settings, *, is_public: Callable[[str, str], bool]) -> None:
        self._trainer = settings.api_key.encode() if settings.api_key is not None else None
        self._admin = (
            settings.admin_api_key.encode() if settings.admin_api_key is not None else None
        )
        self._sessions = SessionKeys.of(settings)
        self._is_public = is_public

    @classmethod
    def of(cls, settings: Settings, *, is_public: Callable[[str, str], bool]) -> Gate | None:
        """The gate for `settings`; None when no route needs a key."""
        if settings.api_key is None and settings.admin_api_key is None:
            return None
        return cls(settings, is_public=is_public)

    def check(
        self, method: str, path: str | None, authorization: bytes, api_key: bytes = b""
    ) -> None:
        """Raise `Unauthorized` (no key, or one that is nobody's) or
        `PermissionDenied` (a known key of a role below the route's)."""
        access, session_id = access_of(method, path, self._is_public)
        if access is Access.PUBLIC:
            return
        if access is Access.OPERATOR:
            if self._admin is None and self._trainer is None:
                return
        elif self._trainer is None:
            return  # sessions and their model routes are open without --api-key
        credential = request_credential(authorization, api_key)
        if credential is None:
            raise Unauthorized(_UNAUTHORIZED)
        # Each comparison in constant time; which one matched is not secret.
        is_admin = self._admin is not None and hmac.compare_digest(credential, self._admin)
        is_trainer = self._trainer is not None and hmac.compare_digest(credential, self._trainer)
        if access is Access.OPERATOR:
            if is_admin or (self._admin is None and is_trainer):
                return
            if is_trainer:
                raise PermissionDenied(
                    "this route needs the operator's key (--admin-api-key), "
                    "not the trainer's (--api-key)"
                )
            raise Unauthorized(_UNAUTHORIZED)
        if is_admin or is_trainer:
            return
        if access is Access.MODEL and session_id is not None and self._sessions is not None:
            expected = self._sessions.key(session_id).encode()
            if hmac.compare_digest(credential, expected):
                return
            raise Unauthorized(_WRONG_SESSION)
        raise Unauthorized(_UNAUTHORIZED)
