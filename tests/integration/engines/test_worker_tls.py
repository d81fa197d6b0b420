"""An ``https`` worker is verified with the pool's one TLS context: the
probes' and every turn connection's. ``--worker-ca FILE`` or
``create_app(worker_tls=...)`` trusts a private CA; without either the pool
uses httpx's context (certifi's bundle), which does not, so such a worker is
never admitted."""

from __future__ import annotations

import contextlib
import ssl
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig, TextModel, start_emulator
from rollout_session.engines.pool import Health
from rollout_session.engines.resolve import resolve_engine
from rollout_session.http.app import server_context
from rollout_session.http.serving import start_server
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.loopback import TLS

USER = [{"role": "user", "content": "hello"}]
FAST: dict[str, Any] = {"health_interval_s": 0.05, "health_timeout_s": 1.0}


async def https_worker(
    nursery: trio.Nursery, model: TextModel, template: ChatTokenizer, ca: trustme.CA
) -> str:
    """An emulator behind a TLS-terminating relay whose certificate `ca`
    issued for 127.0.0.1 (the server itself serves no TLS); its https URL."""
    config = replace(EmulatorConfig(), chat_template=template.chat_template)
    plain, _ = await start_emulator(nursery, config, model=model)
    port = int(plain.url.rsplit(":", 1)[1])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)

    async def relay(client: trio.SSLStream[trio.SocketStream]) -> None:
        # A client that refuses the certificate breaks the handshake: its
        # connection ends, the relay goes on.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            async with (
                client,
                await trio.open_tcp_stream("127.0.0.1", port) as upstream,
                trio.open_nursery() as both,
            ):
                both.start_soon(pump, client, upstream, both.cancel_scope)
                both.start_soon(pump, upstream, client, both.cancel_scope)

    listeners = await nursery.start(
        partial(trio.serve_ssl_over_tcp, relay, 0, context, host="127.0.0.1")
    )
    return f"https://127.0.0.1:{listeners[0].transport_listener.socket.getsockname()[1]}"


async def pump(
    source: trio.abc.ReceiveStream, sink: trio.abc.SendStream, done: trio.CancelScope
) -> None:
    """Bytes one way until either side closes; then the other way stops too."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        async for chunk in source:
            await sink.send_all(chunk)
    done.cancel()


@pytest.mark.parametrize("given", ["worker-ca", "context"], ids=["worker-ca", "context"])
async def test_a_worker_behind_a_private_ca_serves_turns_with_its_context(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
    tmp_path: Path,
    given: str,
) -> None:
    """The CA as `--worker-ca FILE` (Settings.worker_ca), or an embedder's context."""
    ca = trustme.CA()
    worker = await https_worker(nursery, text_model, chat_tokenizers["chatml"], ca)
    settings = Settings(workers=(worker,), port=0, **FAST)
    trusting: ssl.SSLContext | None = None
    if given == "worker-ca":
        pem = tmp_path / "ca.pem"
        ca.cert_pem.write_to_path(str(pem))
        settings = replace(settings, worker_ca=str(pem))
    else:
        trusting = ssl.create_default_context()
        ca.configure_trust(trusting)
    app = create_app(settings, tokenizer=chat_tokenizers["chatml"], worker_tls=trusting)
    server = await start_server(nursery, app)
    async with httpx.AsyncClient(base_url=server.url, timeout=30, verify=TLS) as client:
        session_id = (await client.post("/sessions")).json()["session_id"]
        path = f"/sessions/{session_id}/v1/chat/completions"
        messages: list[dict[str, str]] = list(USER)
        for turn in range(2):
            answer = await client.post(path, json={"messages": messages})
            assert answer.status_code == 200, answer.text
            messages += [
                answer.json()["choices"][0]["message"],
                {"role": "user", "content": f"{turn}"},
            ]
        doc = (await client.get(f"/sessions/{session_id}/trajectory")).json()
    assert [len(s["turns"]) for s in doc["segments"]] == [2]
    await server.aclose()


async def test_without_its_context_a_private_ca_worker_is_never_admitted(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
) -> None:
    worker = await https_worker(nursery, text_model, chat_tokenizers["chatml"], trustme.CA())
    app = create_app(
        Settings(workers=(worker,), port=0, engine="sglang-chat", **FAST),
        tokenizer=chat_tokenizers["chatml"],
    )
    server = await start_server(nursery, app)
    (state,) = server_context(app).pool.workers.values()
    assert state.health is Health.JOINING
    # The reason names the certificate, not a bare "ConnectError".
    assert "CERTIFICATE_VERIFY_FAILED" in (state.last_error or ""), state.last_error
    await server.aclose()


async def test_under_auto_a_worker_it_cannot_verify_stops_the_start_with_the_reason(
    nursery: trio.Nursery,
    text_model: TextModel,
    chat_tokenizers: dict[str, ChatTokenizer],
) -> None:
    """`--engine auto` must hear from a worker to choose the engine: a start
    where none can be read is refused (start-up's `resolve_engine`), naming why."""
    worker = await https_worker(nursery, text_model, chat_tokenizers["chatml"], trustme.CA())
    settings = Settings(workers=(worker,), port=0, **FAST)
    with pytest.raises(ValueError, match="--engine auto: no worker can serve") as refused:
        await resolve_engine(
            settings,
            settings.workers,
            tls=httpx.create_ssl_context(trust_env=False),
            deadline_s=2.0,
            connect_timeout_s=1.0,
        )
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
