"""Roles and keys (auth.py): which access a request needs, the header's
credential, sessions' derived keys, and the gate's decisions."""

from __future__ import annotations

import pytest

from rollout_session import Settings
from rollout_session.errors import PermissionDenied, Unauthorized
from rollout_session.http.app import is_public
from rollout_session.http.auth import (
    Access,
    Gate,
    SessionKeys,
    access_of,
    bearer_credential,
    request_credential,
    session_of_key,
)

WORKERS = ("http://127.0.0.1:9",)


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/health", (Access.PUBLIC, None)),
        ("POST", "/health", (Access.PUBLIC, None)),
        ("GET", "/ui/", (Access.PUBLIC, None)),
        ("POST", "/ui/", (Access.TRAINER, None)),
        ("POST", "/sessions/s1/v1/chat/completions", (Access.MODEL, "s1")),
        ("GET", "/sessions/s1/v1/models", (Access.MODEL, "s1")),
        ("POST", "/sessions/s1/v1/responses", (Access.MODEL, "s1")),
        ("GET", "/sessions/s1/v1", (Access.TRAINER, None)),
        ("GET", "/sessions/s1/x/v1/models", (Access.TRAINER, None)),
        ("GET", "/sessions//v1/models", (Access.TRAINER, None)),
        ("GET", "/sessions/s1", (Access.TRAINER, None)),
        ("GET", "/sessions/s1/diff", (Access.TRAINER, None)),
        ("POST", "/sessions", (Access.TRAINER, None)),
        ("GET", "/workers", (Access.OPERATOR, None)),
        ("GET", "/workers/", (Access.OPERATOR, None)),
        ("POST", "/admin/pause", (Access.OPERATOR, None)),
        ("GET", "/metrics", (Access.OPERATOR, None)),
        ("GET", "/workersx", (Access.TRAINER, None)),
        ("GET", "/nowhere", (Access.TRAINER, None)),
        ("GET", None, (Access.TRAINER, None)),
    ],
    ids=lambda v: str(v) if isinstance(v, str) or v is None else None,
)
def test_access_of(method: str, path: str | None, expected: tuple[Access, str | None]) -> None:
    assert access_of(method, path, is_public) == expected


@pytest.mark.parametrize(
    ("header", "credential"),
    [
        (b"Bearer k", b"k"),
        (b"bearer k", b"k"),
        (b"BEARER k", b"k"),
        (b"Bearer   k", b"k"),
        (b"Bearer k k", b"k k"),
        (b"Bearer", None),
        (b"Bearer ", None),
        (b"Basic k", None),
        (b"k", None),
        (b"", None),
    ],
    ids=["plain", "lower", "upper", "spaces", "inner-space", "no-credential", "empty-credential",
         "basic", "no-scheme", "none"],
)  # fmt: skip
def test_bearer_credential(header: bytes, credential: bytes | None) -> None:
    assert bearer_credential(header) == credential


def test_session_keys_are_per_session_per_trainer_key_and_stable() -> None:
    keys = SessionKeys("trainer")
    assert keys.key("a") == SessionKeys("trainer").key("a")  # a restart: the same
    assert keys.key("a") != keys.key("b")
    assert keys.key("a") != SessionKeys("rotated").key("a")
    assert keys.key("a").startswith("rs-a.") and "trainer" not in keys.key("a")
    assert len(keys.key("a")) == len("rs-a.") + 43  # base64url of 32 bytes, unpadded


@pytest.mark.parametrize(
    ("credential", "session_id"),
    [
        (SessionKeys("t").key("a.b:c-1"), "a.b:c-1"),  # ids may hold dots: the last one splits
        (b"rs-x.mac", "x"),
        (b"trainer-key", None),
        (b"rs-", None),
        (b"rs-.mac", None),
        (b"rs-nodot", None),
    ],
    ids=["dotted-id", "shape", "other-key", "prefix-only", "no-id", "no-mac"],
)
def test_the_session_a_key_names(credential: str | bytes, session_id: str | None) -> None:
    raw = credential.encode() if isinstance(credential, str) else credential
    assert session_of_key(raw) == session_id


def gate(**keys: str) -> Gate:
    found = Gate.of(Settings(workers=WORKERS, **keys), is_public=is_public)  # type: ignore[arg-type]
    assert found is not None
    return found


def outcome(gate: Gate, path: str, key: str | None) -> str:
    header = b"" if key is None else b"Bearer " + key.encode()
    try:
        gate.check("GET", path, header)
    except Unauthorized:
        return "401"
    except PermissionDenied:
        return "403"
    return "ok"


def test_no_keys_no_gate() -> None:
    assert Gate.of(Settings(workers=WORKERS), is_public=is_public) is None


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        # holder → (model route of s1, trainer route, operator route)
        ({"api_key": "T", "admin_api_key": "A"},
         {None: ("401", "401", "401"), "s1": ("ok", "401", "401"), "s2": ("401", "401", "401"),
          "T": ("ok", "ok", "403"), "A": ("ok", "ok", "ok")}),
        ({"api_key": "T"},
         {None: ("401", "401", "401"), "s1": ("ok", "401", "401"), "s2": ("401", "401", "401"),
          "T": ("ok", "ok", "ok"), "A": ("401", "401", "401")}),
        ({"admin_api_key": "A"},
         {None: ("ok", "ok", "401"), "s1": ("ok", "ok", "401"), "s2": ("ok", "ok", "401"),
          "T": ("ok", "ok", "401"), "A": ("ok", "ok", "ok")}),
    ],
    ids=["both", "trainer-only", "operator-only"],
)  # fmt: skip
def test_the_gate(keys: dict[str, str], expected: dict[str | None, tuple[str, str, str]]) -> None:
    the_gate = gate(**keys)
    session_keys = SessionKeys(keys["api_key"]) if "api_key" in keys else None
    for holder, wanted in expected.items():
        key = holder
        if holder in ("s1", "s2"):
            key = session_keys.key(holder) if session_keys else "rs-unknown"
        got = tuple(
            outcome(the_gate, path, key)
            for path in ("/sessions/s1/v1/models", "/sessions", "/workers")
        )
        assert got == wanted, holder


@pytest.mark.parametrize(
    "keys",
    [
        {"api_key": ""},
        {"admin_api_key": ""},
        {"api_key": " k"},
        {"api_key": "k\n"},
        {"api_key": "clé"},
        {"api_key": "same", "admin_api_key": "same"},
    ],
    ids=["empty", "empty-admin", "padded", "newline", "non-ascii", "same-keys"],
)
def test_keys_a_header_cannot_carry_are_refused(keys: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="api_key"):
        Settings(workers=WORKERS, **keys)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("authorization", "api_key", "credential"),
    [
        (b"Bearer a", b"", b"a"),
        (b"", b"b", b"b"),
        (b"Bearer a", b"b", b"a"),  # Authorization wins
        (b"Basic a", b"b", b"b"),
        (b"", b"  ", None),
        (b"", b"", None),
    ],
    ids=["bearer", "x-api-key", "both", "other-scheme", "blank", "none"],
)
def test_request_credential(authorization: bytes, api_key: bytes, credential: bytes | None) -> None:
    assert request_credential(authorization, api_key) == credential


def test_x_api_key_is_checked_as_the_bearer_key() -> None:
    keyed = gate(api_key="trainer", admin_api_key="admin")
    keyed.check("GET", "/sessions", b"", b"trainer")
    keyed.check("GET", "/metrics", b"", b"admin")
    with pytest.raises(PermissionDenied):
        keyed.check("GET", "/metrics", b"", b"trainer")
    with pytest.raises(Unauthorized):
        keyed.check("GET", "/sessions", b"", b"wrong")
    with pytest.raises(Unauthorized):  # Authorization is the one checked
        keyed.check("GET", "/sessions", b"Bearer wrong", b"trainer")
    session_key = SessionKeys("trainer").key("s1").encode()
    keyed.check("POST", "/sessions/s1/v1/messages", b"", session_key)
    with pytest.raises(Unauthorized):
        keyed.check("POST", "/sessions/s2/v1/messages", b"", session_key)
