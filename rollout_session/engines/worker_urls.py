"""Worker URLs: what an operator may name as a worker, and the allow-list.

A worker URL is ``scheme://host[:port][/path]`` and nothing else: the server
POSTs agents' conversations to ``<url>/v1/chat/completions``, so a query,
fragment or user info would let a URL aim those requests somewhere other
than a model server's chat route (``http://host/internal/admin?x=#`` turns
the appended path into a fragment). The path is plain segments (letters,
digits, ``-._~``; no ``.``/``..`` segments, no percent escapes anywhere) for
workers behind a path-routing proxy.

``--worker-hosts`` optionally restricts which hosts may be workers: each
entry is a host name, an IP address or a CIDR network, optionally with a
``:port`` (a bracketed IPv6 address for v6 with a port). Names are compared
as written, never resolved: the allow-list says which names and addresses an
operator may point the server at, not where DNS sends them.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["WorkerHosts", "WorkerUrl", "parse_worker_url", "worker_url"]

_DEFAULT_PORTS = {"http": 80, "https": 443}
# RFC 1123 labels; `_` too, as container and service names use it.
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_SEGMENT = re.compile(r"^[A-Za-z0-9._~-]+$")
_FORBIDDEN = {
    "?": "a query",
    "#": "a fragment",
    "@": "user info",
    "\\": "a backslash",
    "%": "a percent escape",  # in a path, or an IPv6 zone
}

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class WorkerUrl:
    # Normalised: lower-case scheme and host, no trailing "/".
    url: str
    scheme: str
    # Lower case; an IPv6 address without its brackets.
    host: str
    # As written, or the scheme's default.
    port: int


def parse_worker_url(text: str) -> WorkerUrl:
    """The worker URL `text` names; ValueError saying what is wrong with it."""
    if not text or any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError("it is empty or holds whitespace or control characters")
    for char, what in _FORBIDDEN.items():
        if char in text:
            raise ValueError(f"it has {what} ({char!r})")
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # e.g. an unclosed "[" of an IPv6 address
        raise ValueError(str(exc)) from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError("the scheme must be http or https")
    if not text.lower().startswith(f"{scheme}://") or not parts.netloc:
        raise ValueError("it has no host")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError("its port is not a number in 1..65535")
    netloc = parts.netloc.lower()
    host = _host(netloc, port)
    segments = parts.path.split("/")[1:]
    if segments and segments[-1] == "":
        segments.pop()  # one trailing "/" is dropped
    for segment in segments:
        if not _SEGMENT.match(segment) or segment in {".", ".."}:
            raise ValueError(f"its path segment {segment!r} is not a plain name")
    path = "".join(f"/{s}" for s in segments)
    return WorkerUrl(
        url=f"{scheme}://{netloc}{path}",
        scheme=scheme,
        host=host,
        port=_DEFAULT_PORTS[scheme] if port is None else port,
    )


def _host(netloc: str, port: int | None) -> str:
    """The host of `netloc` (lower case), checked to be a name or an address."""
    if port is not None or netloc.endswith(":"):
        netloc = netloc.rsplit(":", 1)[0]
        if not netloc or port is None:
            raise ValueError("its port is empty")
    if netloc.startswith("[") and netloc.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(netloc[1:-1]))
        except ValueError:
            raise ValueError(f"{netloc} is not an IPv6 address") from None
    if not _HOSTNAME.match(netloc) or len(netloc) > 253:
        raise ValueError(f"{netloc!r} is not a host name or IPv4 address")
    try:
        socket.inet_aton(netloc)
    except OSError:
        return netloc  # a name: resolvers look it up
    # Resolvers read every form inet_aton takes as an IPv4 address ("127.1",
    # "2130706433", "0x7f000001", "0177.0.0.1", "127.0.0.0x1" are all
    # 127.0.0.1), which an allow-list of addresses would not expect: only
    # the canonical dotted quad is one.
    try:
        return str(ipaddress.IPv4Address(netloc))
    except ValueError:
        raise ValueError(f"{netloc!r} is not a dotted-quad IPv4 address") from None


@dataclass(frozen=True, slots=True)
class _Rule:
    host: str | None  # a name or an address, as written (lower case)
    network: IpNetwork | None
    port: int | None  # None: any port

    def allows(self, url: WorkerUrl) -> bool:
        if self.port is not None and url.port != self.port:
            return False
        if self.network is None:
            return url.host == self.host
        try:
            address = ipaddress.ip_address(url.host)
        except ValueError:
            return False  # a name is never matched against a network
        return address in self.network


def _rule(entry: str) -> _Rule:
    text = entry.strip().lower()
    port: int | None = None
    if text.startswith("["):
        inner, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"worker host {entry!r}: expected [v6 address]:port")
        text, port = inner, _port(entry, rest[1:]) if rest else None
    elif text.count(":") == 1:
        text, raw_port = text.split(":")
        port = _port(entry, raw_port)
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        if "/" in text or not _HOSTNAME.match(text):
            raise ValueError(
                f"worker host {entry!r} is not a host name, an IP address or a CIDR network"
            ) from None
        return _Rule(host=text, network=None, port=port)
    return _Rule(host=None, network=network, port=port)


def _port(entry: str, raw: str) -> int:
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise ValueError(f"worker host {entry!r}: the port must be a number in 1..65535")
    return int(raw)


@dataclass(frozen=True, slots=True)
class WorkerHosts:
    """The allow-list of `--worker-hosts`."""

    rules: tuple[_Rule, ...]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> WorkerHosts:
        rules = tuple(_rule(e) for e in entries if e.strip())
        if not rules:
            raise ValueError("worker_hosts must name at least one host when set")
        return cls(rules)

    def allows(self, url: WorkerUrl) -> bool:
        return any(rule.allows(url) for rule in self.rules)


def worker_url(text: str, allowed: WorkerHosts | None) -> str:
    """`text` normalised, or ValueError: not a worker URL, or (with an
    allow-list) its host is not allowed."""
    try:
        parsed = parse_worker_url(text)
    except ValueError as exc:
        raise ValueError(
            f"worker URL {text!r} must be http(s)://host[:port][/path] "
            f"(no query, fragment or user info): {exc}"
        ) from None
    if allowed is not None and not allowed.allows(parsed):
        raise ValueError(f"worker URL {text!r}: its host is not in --worker-hosts")
    return parsed.url
