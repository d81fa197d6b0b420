"""The error tree: unique codes, statuses, and the OpenAI body shape."""

from __future__ import annotations

import pickle

import orjson
import pytest

from rollout_session import errors


def leaf_classes() -> list[type[errors.RolloutSessionError]]:
    found: list[type[errors.RolloutSessionError]] = []
    stack = [errors.RolloutSessionError]
    while stack:
        cls = stack.pop()
        subclasses = cls.__subclasses__()
        if not subclasses:
            found.append(cls)
        stack.extend(subclasses)
    return found


def test_every_error_class_has_a_unique_code_and_a_status() -> None:
    leaves = leaf_classes()
    assert len(leaves) >= 15
    codes = [cls.code for cls in leaves]
    assert len(codes) == len(set(codes)), sorted(codes)
    for cls in leaves:
        assert 400 <= cls.status_code <= 599, cls
        assert cls.__name__ in errors.__all__


@pytest.mark.parametrize(
    ("cls", "status", "code"),
    [
        (errors.InvalidRequest, 400, "invalid_request"),
        (errors.TrajectoryDiverged, 400, "trajectory_diverged"),
        (errors.ContextLengthExceeded, 400, "context_length_exceeded"),
        (errors.Unauthorized, 401, "unauthorized"),
        (errors.SessionNotFound, 404, "session_not_found"),
        (errors.SessionClosing, 404, "session_closing"),
        (errors.SessionBusy, 409, "session_busy"),
        (errors.SessionExists, 409, "session_exists"),
        (errors.RequestTooLarge, 413, "request_too_large"),
        (errors.TooManySessions, 429, "too_many_sessions"),
        (errors.UpstreamError, 502, "upstream_error"),
        (errors.NoHealthyWorker, 503, "no_healthy_worker"),
        (errors.UpstreamTimeout, 504, "upstream_timeout"),
        (errors.InvariantViolated, 500, "invariant_violated"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_design_table(cls: type[errors.RolloutSessionError], status: int, code: str) -> None:
    assert (cls.status_code, cls.code) == (status, code)


def test_body_shape_and_headers() -> None:
    error = errors.SessionBusy("busy")
    assert orjson.loads(error.to_body()) == {
        "error": {
            "message": "busy",
            "type": "conflict_error",
            "code": "session_busy",
            "param": None,
        }
    }
    assert error.headers == {"Retry-After": "1"}
    # The connection's fate is the HTTP edge's (it closes after a 413).
    assert errors.RequestTooLarge("big").headers == {}
    assert errors.MethodNotAllowed("no", allowed=["POST", "GET"]).headers == {"Allow": "GET, POST"}
    assert errors.UpstreamMalformed("bad", kind="json").kind == "json"


@pytest.mark.parametrize("cls", leaf_classes(), ids=lambda cls: cls.__name__)
def test_every_error_survives_pickling(cls: type[errors.RolloutSessionError]) -> None:
    # Validation runs in worker processes: its errors come back pickled.
    if cls is errors.UpstreamMalformed:
        error: errors.RolloutSessionError = errors.UpstreamMalformed("bad logprob", kind="logprob")
    else:
        error = cls("message")
    error.param = "messages"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert vars(copy) == vars(error) and copy.args == error.args
    assert copy.to_body() == error.to_body()
