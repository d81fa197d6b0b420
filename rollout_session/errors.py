"""The error tree: every error an HTTP client of the server can see.

Like httpx's ``_exceptions``: one base class, one subclass per failure, each
carrying its HTTP ``status_code`` and its stable ``code`` (docs/api.md#errors). The HTTP
edge (`http.edge.error_response`) turns any of them into the OpenAI error body
``{"error": {"message", "type", "code", "param"}}`` so the official SDK raises
the matching exception with our message.

Tree::

    RolloutSessionError
    ├── ClientError (4xx, the request is at fault)
    │   ├── InvalidRequest (TemplateCannotExtend), TrajectoryDiverged,
    │   │   TooManySegments, ContextLengthExceeded, SessionTooLarge
    │   ├── Unauthorized, PermissionDenied, RouteNotFound, MethodNotAllowed
    │   ├── SessionNotFound, SessionClosing, SessionBusy, SessionExists
    │   ├── RequestTooLarge, TooManySessions, WorkerExists, WorkerNotFound
    └── ServerError (5xx)
        ├── UpstreamError (WorkerUnfit), UpstreamMalformed, UpstreamTimeout, NoHealthyWorker
        ├── ServerPaused, JournalUnavailable
        └── InvariantViolated, InternalError
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import orjson

__all__ = [
    "ClientError",
    "ContextLengthExceeded",
    "InternalError",
    "InvalidRequest",
    "InvariantViolated",
    "JournalUnavailable",
    "MethodNotAllowed",
    "NoHealthyWorker",
    "PermissionDenied",
    "RequestTooLarge",
    "RescoreInterrupted",
    "RolloutSessionError",
    "RouteNotFound",
    "ServerError",
    "ServerPaused",
    "SessionBusy",
    "SessionClosing",
    "SessionExists",
    "SessionNotFound",
    "SessionTooLarge",
    "ShardUnavailable",
    "TemplateCannotExtend",
    "TooManySegments",
    "TooManySessions",
    "TrajectoryDiverged",
    "TurnInterrupted",
    "Unauthorized",
    "UpstreamError",
    "UpstreamMalformed",
    "UpstreamTimeout",
    "WorkerExists",
    "WorkerNotFound",
    "WorkerUnfit",
    "error_body",
]


class RolloutSessionError(Exception):
    """Base of every error the server answers with."""

    status_code: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    # OpenAI's `type` field: clients branch on it less than on the status.
    error_type: ClassVar[str] = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def to_body(self) -> bytes:
        return error_body(self.message, self.error_type, self.code, self.param)

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors raised in a validation worker process come back pickled; the
        # default reduce would call __init__ with positional args only, which
        # breaks keyword-only fields (UpstreamMalformed's `kind`).
        return (_restore, (type(self), self.message, dict(vars(self))))


def _restore(
    cls: type[RolloutSessionError], message: str, state: dict[str, Any]
) -> RolloutSessionError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


def error_body(message: str, error_type: str, code: str, param: str | None = None) -> bytes:
    """The OpenAI error document, serialised."""
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "code": code, "param": param}}
    )


class ClientError(RolloutSessionError):
    status_code = 400
    code = "invalid_request"
    error_type = "invalid_request_error"


class InvalidRequest(ClientError):
    """Malformed JSON, wrong types, unsupported values; never reaches a worker."""

    code = "invalid_request"


class TemplateCannotExtend(InvalidRequest):
    """The chat template would render the appended messages somewhere other
    than after the history (it moves them), so they cannot be appended
    token-in/token-out. `check-template` reports the same up front."""


class TrajectoryDiverged(ClientError):
    """The messages do not extend the session's history and no rollback applies."""

    code = "trajectory_diverged"


class TooManySegments(ClientError):
    """A request would start one more segment than --max-segments allows:
    each holds up to a context of tokens, so their number bounds a session's
    memory. Extensions and retries still work."""

    code = "too_many_segments"


class ContextLengthExceeded(ClientError):
    code = "context_length_exceeded"


class SessionTooLarge(ClientError):
    """A request would make its session keep more text than --max-session-mb
    (messages of every segment, reasoning and fields the template never
    renders included): token caps do not see text that is never rendered,
    so this bounds a session's memory and journal. Nothing was stored."""

    code = "session_too_large"


class Unauthorized(ClientError):
    status_code = 401
    code = "unauthorized"
    error_type = "authentication_error"


class PermissionDenied(ClientError):
    """A valid key that does not reach this route (the trainer's key on an
    operator route): OpenAI's 403, which its SDK raises as
    ``PermissionDeniedError``."""

    status_code = 403
    code = "permission_denied"
    error_type = "permission_error"


class RouteNotFound(ClientError):
    status_code = 404
    code = "not_found"


class MethodNotAllowed(ClientError):
    status_code = 405
    code = "method_not_allowed"

    def __init__(self, message: str, *, allowed: Iterable[str] = ()) -> None:
        methods = ", ".join(sorted(allowed))
        super().__init__(message, headers={"Allow": methods} if methods else None)


class SessionNotFound(ClientError):
    status_code = 404
    code = "session_not_found"
    error_type = "not_found_error"


class SessionClosing(ClientError):
    """A DELETE is under way; it wins over a concurrent or in-flight turn."""

    status_code = 404
    code = "session_closing"
    error_type = "not_found_error"


class SessionBusy(ClientError):
    """The session already has a turn in flight; the worker never saw this request."""

    status_code = 409
    code = "session_busy"
    error_type = "conflict_error"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class SessionExists(ClientError):
    status_code = 409
    code = "session_exists"
    error_type = "conflict_error"


class RequestTooLarge(ClientError):
    """Body over --max-body-mb. It is left unread, so the HTTP edge closes the
    connection after the answer (``Connection: close``)."""

    status_code = 413
    code = "request_too_large"

    def __init__(self, message: str = "request body is larger than the server's limit") -> None:
        super().__init__(message)


class WorkerExists(ClientError):
    status_code = 409
    code = "worker_exists"
    error_type = "conflict_error"


class WorkerNotFound(ClientError):
    status_code = 404
    code = "worker_not_found"
    error_type = "not_found_error"


class TooManySessions(ClientError):
    status_code = 429
    code = "too_many_sessions"
    error_type = "rate_limit_error"


class ServerError(RolloutSessionError):
    status_code = 500
    code = "internal_error"
    error_type = "server_error"


class UpstreamError(ServerError):
    """Transport failure talking to the worker (after the retry rule)."""

    status_code = 502
    code = "upstream_error"


class WorkerUnfit(UpstreamError):
    """A worker of the engine's kind, launched without what the engine needs;
    the message names the launch flag (`--enable-scale-out`, ...)."""


class UpstreamMalformed(ServerError):
    """A 200 from the worker failed strict validation; nothing was committed."""

    status_code = 502
    code = "upstream_malformed"

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        # Short machine-readable reason (e.g. "logprob_not_finite") for logs/metrics.
        self.kind = kind


class NoHealthyWorker(ServerError):
    status_code = 503
    code = "no_healthy_worker"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class ServerPaused(ServerError):
    """Turns are paused (weight sync) and did not resume within --pause-wait-s."""

    status_code = 503
    code = "server_paused"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class TurnInterrupted(ServerError):
    """The turn's worker aborted it more often than --max-continuations
    allows: nothing was committed, and the partial completion is dropped."""

    status_code = 503
    code = "turn_interrupted"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class RescoreInterrupted(ServerError):
    """The worker aborted the rescore's scoring request (a weight update or
    a pause at the worker) more often than --max-continuations allows,
    before it had scored every position: nothing was stored."""

    status_code = 503
    code = "rescore_interrupted"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class JournalUnavailable(ServerError):
    """The journal cannot record a change now (a write failed), so nothing was
    changed: the session is as it was before the request. Every change is
    refused until the journal writes again (it retries by itself); reads
    still answer. Also `/ready`'s answer meanwhile."""

    status_code = 503
    code = "journal_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 5) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class ShardUnavailable(ServerError):
    """Another session server of the fleet, which this request needed, did
    not answer (docs/deploy.md#a-fleet)."""

    status_code = 503
    code = "shard_unavailable"


class UpstreamTimeout(ServerError):
    status_code = 504
    code = "upstream_timeout"


class InvariantViolated(ServerError):
    """An internal state check failed; logged at ERROR with the session id."""

    code = "invariant_violated"


class InternalError(ServerError):
    """An unexpected exception: answered without a stack trace, logged with one."""

    code = "internal_error"
