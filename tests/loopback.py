"""One TLS context for every HTTP client and app the tests build.

Building an httpx client (ours, or the httpx2 inside the OpenAI and
Anthropic SDKs) builds a TLS context, and that loads the CA bundle: tens of
milliseconds of CPU per client, about a quarter of the default suite's CPU
while every test built its own. The servers under test speak plain HTTP on
loopback; the context is shared only so that it is built once.
"""

from __future__ import annotations

import httpx

__all__ = ["TLS"]

TLS = httpx.create_ssl_context()
