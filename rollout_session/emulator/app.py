"""The emulator's HTTP face: the Quart-Trio app of one engine's routes, and serving it.

Owns `create_emulator_app` (one `Emulator` per app, reachable as
``app.extensions["emulator"]``; SGLang's routes from `sglang.routes` or,
with ``engine="vllm"``, vLLM's from `vllm.routes`; the fault middleware of
`faults`) and `start_emulator`.
"""

from __future__ import annotations

from typing import Any

import trio
from quart_trio import QuartTrio

from rollout_session.emulator.faults import BodyFaultMiddleware
from rollout_session.emulator.model.generation import TextModel
from rollout_session.emulator.sglang.routes import add_sglang_routes
from rollout_session.emulator.vllm.routes import add_vllm_routes
from rollout_session.emulator.worker import Emulator, EmulatorConfig
from rollout_session.http.serving import RunningServer, start_server

__all__ = ["create_emulator_app", "start_emulator"]


def create_emulator_app(
    config: EmulatorConfig, *, tokenizer: Any = None, model: TextModel | None = None
) -> QuartTrio:
    """The emulator's Quart-Trio app; its `Emulator` is ``app.extensions["emulator"]``.

    Tests that start many emulators pass what they already loaded for
    ``config.tokenizer_path``: ``tokenizer`` (an HF tokenizer) saves loading it
    from disk, ``model`` (a `TextModel`, shareable) also saves its vocabulary scan.
    """
    if model is None and tokenizer is not None:
        model = TextModel(tokenizer)
    # Named after `worker`, not this module: the app's logger is the emulator's.
    app = QuartTrio("rollout_session.emulator.worker")
    # Quart's defaults cut long requests and responses; the emulator stalls on purpose.
    app.config.update(MAX_CONTENT_LENGTH=None, BODY_TIMEOUT=None, RESPONSE_TIMEOUT=None)
    emulator = Emulator(config, model)
    app.extensions["emulator"] = emulator
    if config.engine == "vllm":
        add_vllm_routes(app, emulator)
    else:
        add_sglang_routes(app, emulator)
    # Quart's documented middleware hook: wrap asgi_app, keep the app object.
    app.asgi_app = BodyFaultMiddleware(  # type: ignore[method-assign]
        app.asgi_app, on_endless_end=emulator.note_endless_end
    )
    return app


async def start_emulator(
    nursery: trio.Nursery,
    config: EmulatorConfig | None = None,
    *,
    tokenizer: Any = None,
    model: TextModel | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> tuple[RunningServer, Emulator]:
    """Serve an emulator in ``nursery`` (port 0: a free port); returns it once listening.

    ``tokenizer``/``model``: see `create_emulator_app`.
    """
    app = create_emulator_app(config or EmulatorConfig(), tokenizer=tokenizer, model=model)
    server = await start_server(nursery, app, host=host, port=port)
    emulator: Emulator = app.extensions["emulator"]
    return server, emulator
