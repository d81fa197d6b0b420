"""Worker URLs: only scheme://host[:port][/path], and the --worker-hosts allow-list."""

from __future__ import annotations

import pytest

from rollout_session import Settings
from rollout_session.engines.worker_urls import WorkerHosts, parse_worker_url, worker_url

# Each would let a worker URL aim the server's POST of agents' conversations
# (and its relay of the answer) somewhere other than a model server's chat
# route, or hide where it points.
REFUSED = {
    "query-and-fragment": "http://127.0.0.1:8000/internal/admin?token=x#",
    "query": "http://127.0.0.1:8000/?a=1",
    "empty-query": "http://127.0.0.1:8000?",
    "fragment": "http://127.0.0.1:8000/v1#",
    "userinfo": "http://user@127.0.0.1:8000",
    "userinfo-password": "http://user:pw@127.0.0.1:8000",
    "userinfo-host-confusion": "http://10.0.0.5:30000@169.254.169.254",
    "backslash": "http://127.0.0.1:8000\\@evil",
    "space": "http://127.0.0.1:8000/a b",
    "crlf": "http://127.0.0.1:8000/\r\nX-Injected: 1",
    "tab": "http://127.0.0.1\t:8000",
    "dot-dot-segment": "http://127.0.0.1:8000/a/../admin",
    "dot-segment": "http://127.0.0.1:8000/./admin",
    "percent-escape": "http://127.0.0.1:8000/%2e%2e/admin",
    "short-ipv4": "http://127.1:8000",
    "integer-ipv4": "http://2130706433:8000",
    "hex-ipv4": "http://0x7f.0.0.1:8000",
    "hex-integer-ipv4": "http://0x7f000001:8000",
    "hex-last-part-ipv4": "http://127.0.0.0x1:8000",
    "octal-ipv4": "http://0177.0.0.1:8000",
    "port-zero": "http://127.0.0.1:0",
    "port-too-large": "http://127.0.0.1:65536",
    "port-not-a-number": "http://127.0.0.1:80a",
    "empty-port": "http://127.0.0.1:",
    "unclosed-ipv6": "http://[::1:8000",
    "ipv6-zone": "http://[fe80::1%25eth0]:8000",
    "no-host": "http:///v1",
    "no-slashes": "http:127.0.0.1:8000",
    "file-scheme": "file:///etc/passwd",
    "gopher-scheme": "gopher://127.0.0.1:70/",
    "no-scheme": "127.0.0.1:8000",
    "empty": "",
}

ACCEPTED = {
    "ip-port": ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
    "trailing-slash": ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
    "name-path": (
        "HTTPS://GPU-3.Cluster.local/sglang/w_1/",
        "https://gpu-3.cluster.local/sglang/w_1",
    ),
    "ipv6": ("http://[::1]:8000", "http://[::1]:8000"),
    "no-port": ("http://worker", "http://worker"),
}


@pytest.mark.parametrize("url", REFUSED.values(), ids=REFUSED.keys())
def test_refused_worker_urls(url: str) -> None:
    with pytest.raises(ValueError, match="must be http"):
        worker_url(url, None)
    with pytest.raises(ValueError, match="must be http"):
        Settings(workers=(url,))


@pytest.mark.parametrize(("url", "normal"), ACCEPTED.values(), ids=ACCEPTED.keys())
def test_accepted_worker_urls_are_normalised(url: str, normal: str) -> None:
    assert worker_url(url, None) == normal
    assert Settings(workers=(url,)).workers == (normal,)


HOSTS = ["10.0.0.0/8", "gpu-1:30000", "[::1]:9000", "localhost"]
ALLOWED = {
    "in-network": "http://10.2.3.4:30000",
    "name-and-port": "http://gpu-1:30000",
    "v6-and-port": "http://[::1]:9000",
    "name-any-port": "http://localhost:1234",
}
NOT_ALLOWED = {
    "outside-network": "http://192.168.0.1:30000",
    "metadata-address": "http://169.254.169.254",
    "name-other-port": "http://gpu-1:30001",
    "v6-other-port": "http://[::1]:9001",
    "name-not-resolved-into-network": "http://ten.example:30000",
    "loopback-not-listed": "http://127.0.0.1:30000",
}


@pytest.mark.parametrize("url", ALLOWED.values(), ids=ALLOWED.keys())
def test_allow_list_admits(url: str) -> None:
    assert WorkerHosts.parse(HOSTS).allows(parse_worker_url(url))
    assert Settings(workers=(url,), worker_hosts=frozenset(HOSTS)).workers == (url,)


@pytest.mark.parametrize("url", NOT_ALLOWED.values(), ids=NOT_ALLOWED.keys())
def test_allow_list_refuses(url: str) -> None:
    assert not WorkerHosts.parse(HOSTS).allows(parse_worker_url(url))
    with pytest.raises(ValueError, match="not in --worker-hosts"):
        Settings(workers=(url,), worker_hosts=frozenset(HOSTS))


@pytest.mark.parametrize(
    "entry",
    ["", "host:port", "10.0.0.0/33", "bad host", "[::1]x", "a/b", "gpu-1:0"],
    ids=["empty", "port-not-a-number", "bad-prefix", "space", "junk-after-v6", "slash", "port-0"],
)
def test_bad_allow_list_entries_are_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="worker"):
        Settings(demo=True, worker_hosts=frozenset({entry}))
