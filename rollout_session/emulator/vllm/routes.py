"""vLLM 0.33.0's HTTP routes over an `Emulator`: thin Quart adapters.

Owns `add_vllm_routes`: ``/health``, ``/version``, ``/load``,
``/v1/models`` (``entrypoints/openai/models/serving.py``
``show_available_models``); with ``--enable-scale-out``
(``entrypoints/scale_out/factories.py`` ``register_scale_out_api_routers``)
``/inference/v1/generate`` (`serve_tokens`),
``/inference/v1/abort_requests``, ``/v1/chat/completions/render``
(`render`) and ``/derender`` (`derender`), else their 403; in dev mode
the RL routes ``/pause``, ``/resume``, ``/is_paused``,
``/update_weight_version``, ``/weight_info``, ``/abort_requests``
(`weight_routes`); FastAPI's 404 and 405; plus ``/emulator/stats``. What
a call does is `VllmWorker`'s job; this module only moves bytes and
status codes between it and HTTP.
"""

from __future__ import annotations

import time
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from rollout_session.emulator.http_io import json_response, raw_body, reply_response
from rollout_session.emulator.vllm import weight_routes
from rollout_session.emulator.vllm.chat_protocol import random_uuid
from rollout_session.emulator.vllm.derender import DERENDER_PATH
from rollout_session.emulator.vllm.errors import error_body as vllm_error_body
from rollout_session.emulator.vllm.names import VLLM_VERSION
from rollout_session.emulator.vllm.render import RENDER_PATH
from rollout_session.emulator.vllm.worker import VllmWorker
from rollout_session.emulator.worker import Emulator

__all__ = ["add_vllm_routes"]


# vLLM's scale-out paths (`entrypoints/scale_out/factories.py`
# `register_scale_out_api_routers`): /render, /derender and the token routes.
_SCALE_OUT_MESSAGE = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
_RENDER_PATHS = (
    "/v1/chat/completions/render",
    "/v1/messages/render",
    "/v1/completions/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
)
# vLLM routes a session server could call that the emulator does not serve.
_UNMODELLED_PATHS = ("/v1/chat/completions", "/v1/completions")


def _vllm_error(message: str, type_: str, code: int) -> Response:
    return Response(
        vllm_error_body(message, type_, code), status=code, content_type="application/json"
    )


def add_vllm_routes(app: QuartTrio, emulator: Emulator) -> None:
    """vLLM 0.33's routes (and nothing of SGLang's) over ``emulator``: a
    session server that speaks SGLang to this worker fails."""
    config = emulator.config
    worker = VllmWorker(emulator)

    async def health() -> Response:
        # entrypoints/serve/instrumentator/health.py: 200, empty body.
        return Response(b"", 200)

    async def version() -> Response:
        return json_response({"version": VLLM_VERSION})

    async def load() -> Response:
        # entrypoints/serve/instrumentator/basic.py: 0 without
        # --enable-server-load-tracking (off by default).
        return json_response({"server_load": 0})

    async def models() -> Response:
        # entrypoints/openai/models/serving.py show_available_models; root is
        # the model path (the tokenizer directory: the session server loads
        # the tokenizer from it).
        now = int(time.time())
        permission = {
            "id": f"modelperm-{random_uuid()}",
            "object": "model_permission",
            "created": now,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {
            "id": config.model_name,
            "object": "model",
            "created": now,
            "owned_by": "vllm",
            "root": str(config.tokenizer_path),
            "parent": None,
            "max_model_len": config.context_length,
            "permission": [permission],
        }
        return json_response({"object": "list", "data": [card]})

    async def generate() -> Response:
        raw = await raw_body()
        headers = {name.lower(): value for name, value in request.headers.items()}
        return reply_response(await worker.generate(raw, headers))

    async def render() -> Response:
        raw = await raw_body()
        headers = {name.lower(): value for name, value in request.headers.items()}
        return reply_response(await worker.render(raw, headers))

    async def derender() -> Response:
        raw = await raw_body()
        headers = {name.lower(): value for name, value in request.headers.items()}
        return reply_response(await worker.derender(raw, headers))

    async def abort_requests() -> Response:
        return reply_response(worker.abort_requests(await raw_body()))

    async def scale_out_disabled() -> Response:
        return _vllm_error(_SCALE_OUT_MESSAGE, "PermissionDeniedError", 403)

    async def not_served() -> Response:
        return _vllm_error(
            f"the emulator does not model vLLM's {request.path}: it serves "
            f"/inference/v1/generate and {RENDER_PATH}",
            "NotImplementedError",
            501,
        )

    async def stats() -> Response:
        return json_response(emulator.stats())

    # The RL routes (entrypoints/rl/online/api_router.py), dev mode only.
    weights = emulator.weights

    async def pause() -> Response:
        query = {key: request.args.getlist(key)[-1] for key in request.args}
        return reply_response(await weight_routes.vllm_pause(weights, query))

    async def resume() -> Response:
        return reply_response(weight_routes.vllm_resume(weights))

    async def is_paused() -> Response:
        return reply_response(weight_routes.vllm_is_paused(weights))

    async def update_weight_version() -> Response:
        return reply_response(weight_routes.vllm_update_weight_version(weights, await raw_body()))

    async def weight_info() -> Response:
        return reply_response(weight_routes.vllm_weight_info(weights))

    async def rl_abort_requests() -> Response:
        return reply_response(weight_routes.vllm_abort_requests(weights, await raw_body()))

    routes: list[tuple[str, Any, str]] = [
        ("/health", health, "GET"),
        ("/version", version, "GET"),
        ("/load", load, "GET"),
        ("/v1/models", models, "GET"),
        ("/emulator/stats", stats, "GET"),
        *((path, not_served, "POST") for path in _UNMODELLED_PATHS),
    ]
    if config.dev_mode:
        routes += [
            ("/pause", pause, "POST"),
            ("/resume", resume, "POST"),
            ("/is_paused", is_paused, "GET"),
            ("/update_weight_version", update_weight_version, "POST"),
            ("/weight_info", weight_info, "GET"),
            ("/abort_requests", rl_abort_requests, "POST"),
        ]
    if config.enable_scale_out:
        routes += [
            ("/inference/v1/generate", generate, "POST"),
            ("/inference/v1/abort_requests", abort_requests, "POST"),
            (RENDER_PATH, render, "POST"),
            (DERENDER_PATH, derender, "POST"),
            *(
                (path, not_served, "POST")
                for path in _RENDER_PATHS
                if path not in (RENDER_PATH, DERENDER_PATH)
            ),
        ]
    else:
        paths = (*_RENDER_PATHS, "/inference/v1/generate", "/inference/v1/abort_requests")
        routes += [(path, scale_out_disabled, "POST") for path in paths]
    for path, view, method in routes:
        app.add_url_rule(path, view_func=view, methods=[method], endpoint=f"{view.__name__}:{path}")

    # FastAPI's (Starlette's) answers for an unknown path or method.
    async def not_found(_: Exception) -> Response:
        return Response(b'{"detail":"Not Found"}', 404, content_type="application/json")

    async def not_allowed(_: Exception) -> Response:
        return Response(b'{"detail":"Method Not Allowed"}', 405, content_type="application/json")

    app.register_error_handler(404, not_found)
    app.register_error_handler(405, not_allowed)
