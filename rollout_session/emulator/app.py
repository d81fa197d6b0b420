"""The emulator's HTTP face: the Quart-Trio app, its SGLang or vLLM routes, and serving it.

Owns `create_emulator_app` (one `Emulator` per app, reachable as
``app.extensions["emulator"]``), the thin route adapters (SGLang's
``/health``, ``/get_model_info`` and ``/model_info``, ``/server_info`` and
``/get_server_info``, ``/v1/models``, ``/v1/chat/completions``,
``/generate``, ``/parse_function_call``, ``/separate_reasoning``, ``/open_session``,
``/close_session``, and the weight-update routes ``/update_weight_version``,
``/update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``,
``/abort_request``; or, with ``engine="vllm"``, vLLM's ``/health``, ``/version``,
``/load``, ``/v1/models``, ``/inference/v1/generate``,
``/inference/v1/abort_requests``, ``/v1/chat/completions/render``, and in
dev mode the RL routes ``/pause``, ``/resume``, ``/is_paused``,
``/update_weight_version``, ``/weight_info``, ``/abort_requests``; plus
``/emulator/stats``) and
`start_emulator`. What a call does is the `Emulator`'s job (`emulator`);
this module only moves bytes and status codes between it and HTTP.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import trio
from quart import Response, request
from quart_trio import QuartTrio

from rollout_session.emulator import weight_routes
from rollout_session.emulator.faults import FAULT_HEADER, BodyFaultMiddleware, Reply
from rollout_session.emulator.model.generation import TextModel
from rollout_session.emulator.vllm.generate import error_body as vllm_error_body
from rollout_session.emulator.vllm.generate import random_uuid
from rollout_session.emulator.vllm.names import VLLM_VERSION
from rollout_session.emulator.vllm.render import RENDER_PATH
from rollout_session.emulator.worker import Emulator, EmulatorConfig
from rollout_session.http.serving import RunningServer, start_server

DERENDER_PATH = "/v1/chat/completions/derender"

__all__ = ["SGLANG_VERSION", "create_emulator_app", "start_emulator"]

# The SGLang release the emulator models (what /server_info reports as `version`).
SGLANG_VERSION = "0.5.23"


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), content_type="application/json")


def _reply(reply: Reply) -> Response:
    return Response(
        reply.body, status=reply.status, content_type=reply.content_type, headers=reply.headers
    )


async def _raw_body() -> bytes:
    data: bytes = await request.get_data(cache=False, as_text=False, parse_form_data=False)
    return data


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
    # Named after `emulator`, not this module: the app's logger is the emulator's.
    app = QuartTrio("rollout_session.emulator.worker")
    # Quart's defaults cut long requests and responses; the emulator stalls on purpose.
    app.config.update(MAX_CONTENT_LENGTH=None, BODY_TIMEOUT=None, RESPONSE_TIMEOUT=None)
    emulator = Emulator(config, model)
    app.extensions["emulator"] = emulator
    if config.engine == "vllm":
        _add_vllm_routes(app, emulator)
    else:
        _add_sglang_routes(app, emulator)
    # Quart's documented middleware hook: wrap asgi_app, keep the app object.
    app.asgi_app = BodyFaultMiddleware(  # type: ignore[method-assign]
        app.asgi_app, on_endless_end=emulator.note_endless_end
    )
    return app


def _add_sglang_routes(app: QuartTrio, emulator: Emulator) -> None:
    config = emulator.config

    weights = emulator.weights

    async def health() -> Response:
        return _json({})

    async def model_info() -> Response:
        # http_server.model_info (and /get_model_info, its deprecated alias):
        # the tokenizer manager's live model path, served name, load format
        # and weight version (moved by weight updates).
        return _json(
            {
                "model_path": weights.model_path,
                "served_model_name": weights.model_path,
                "tokenizer_path": str(config.tokenizer_path),
                "is_generation": True,
                "weight_version": weights.reported_version,
                "load_format": weights.load_format,
            }
        )

    async def server_info() -> Response:
        # SGLang's /server_info (and /get_server_info, its deprecated alias)
        # is its resolved server args (flat, by field name) plus live
        # scheduler state and `version`; these are the fields the emulator
        # models. Its weight_version is the launch one: a weight update moves
        # /model_info's, not this.
        return _json(
            {
                "model_path": config.model_name,
                "tokenizer_path": str(config.tokenizer_path),
                "served_model_name": config.model_name,
                "context_length": config.context_length,
                "page_size": config.cache_block_tokens,
                "max_total_num_tokens": config.cache_capacity_tokens,
                "enable_streaming_session": config.enable_streaming_session,
                "enable_session_radix_cache": config.enable_session_radix_cache,
                "disable_radix_cache": config.cache_capacity_tokens == 0,
                "weight_version": config.weight_version,
                "dp_size": 1,
                "version": SGLANG_VERSION,
            }
        )

    async def models() -> Response:
        model = {
            "id": config.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": config.model_name,
            "max_model_len": config.context_length,
        }
        return _json({"object": "list", "data": [model]})

    async def chat() -> Response:
        raw = await _raw_body()
        headers = {name.lower(): value for name, value in request.headers.items()}
        return _reply(await emulator.handle_chat(raw, request.headers.get(FAULT_HEADER), headers))

    async def generate() -> Response:
        return _reply(await emulator.handle_generate(await _raw_body()))

    async def parse_function_call() -> Response:
        return _reply(emulator.parse_function_call(await _raw_body()))

    async def separate_reasoning() -> Response:
        return _reply(emulator.separate_reasoning(await _raw_body()))

    async def open_session() -> Response:
        # SGLang answers with the session id as a JSON string.
        return _reply(emulator.open_session(await _raw_body()))

    async def close_session() -> Response:
        reply = emulator.close_session(await _raw_body())
        if reply.status == 200:
            return Response(b"", 200)  # SGLang: Response(status_code=200), no body
        return _reply(reply)

    async def stats() -> Response:
        return _json(emulator.stats())

    # Weight updates, pauses, aborts (weight_routes, weights).
    async def update_weight_version() -> Response:
        return _reply(weight_routes.sglang_update_weight_version(weights, await _raw_body()))

    async def update_weights_from_disk() -> Response:
        raw = await _raw_body()
        return _reply(await weight_routes.sglang_update_weights_from_disk(weights, raw))

    async def pause_generation() -> Response:
        return _reply(await weight_routes.sglang_pause_generation(weights, await _raw_body()))

    async def continue_generation() -> Response:
        return _reply(weight_routes.sglang_continue_generation(weights, await _raw_body()))

    async def abort_request() -> Response:
        return _reply(weight_routes.sglang_abort_request(weights, await _raw_body()))

    for path, view, method in (
        ("/health", health, "GET"),
        ("/get_model_info", model_info, "GET"),
        ("/model_info", model_info, "GET"),
        ("/server_info", server_info, "GET"),
        ("/get_server_info", server_info, "GET"),
        ("/update_weight_version", update_weight_version, "POST"),
        ("/update_weights_from_disk", update_weights_from_disk, "POST"),
        ("/pause_generation", pause_generation, "POST"),
        ("/continue_generation", continue_generation, "POST"),
        ("/abort_request", abort_request, "POST"),
        ("/v1/models", models, "GET"),
        ("/v1/chat/completions", chat, "POST"),
        ("/generate", generate, "POST"),
        ("/parse_function_call", parse_function_call, "POST"),
        ("/separate_reasoning", separate_reasoning, "POST"),
        ("/open_session", open_session, "POST"),
        ("/close_session", close_session, "POST"),
        ("/emulator/stats", stats, "GET"),
    ):
        app.add_url_rule(path, view_func=view, methods=[method], endpoint=f"{view.__name__}:{path}")


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


def _add_vllm_routes(app: QuartTrio, emulator: Emulator) -> None:
    """vLLM 0.33's routes (and nothing of SGLang's): a session server that
    speaks SGLang to this worker fails."""
    config = emulator.config

    async def health() -> Response:
        # entrypoints/serve/instrumentator/health.py: 200, empty body.
        return Response(b"", 200)

    async def version() -> Response:
        return _json({"version": VLLM_VERSION})

    async def load() -> Response:
        # entrypoints/serve/instrumentator/basic.py: 0 without
        # --enable-server-load-tracking (off by default).
        return _json({"server_load": 0})

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
        return _json({"object": "list", "data": [card]})

    async def generate() -> Response:
        raw = await _raw_body()
        headers = {name.lower(): value for name, value in request.headers.items()}
        return _reply(await emulator.handle_vllm_generate(raw, headers))

    async def render() -> Response:
        raw = await _raw_body()
        headers = {name.lower(): value for name, value in request.headers.items()}
        return _reply(await emulator.handle_vllm_render(raw, headers))

    async def derender() -> Response:
        raw = await _raw_body()
        headers = {name.lower(): value for name, value in request.headers.items()}
        return _reply(await emulator.handle_vllm_derender(raw, headers))

    async def abort_requests() -> Response:
        return _reply(emulator.vllm_abort_requests(await _raw_body()))

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
        return _json(emulator.stats())

    # The RL routes (entrypoints/rl/online/api_router.py), dev mode only.
    weights = emulator.weights

    async def pause() -> Response:
        query = {key: request.args.getlist(key)[-1] for key in request.args}
        return _reply(await weight_routes.vllm_pause(weights, query))

    async def resume() -> Response:
        return _reply(weight_routes.vllm_resume(weights))

    async def is_paused() -> Response:
        return _reply(weight_routes.vllm_is_paused(weights))

    async def update_weight_version() -> Response:
        return _reply(weight_routes.vllm_update_weight_version(weights, await _raw_body()))

    async def weight_info() -> Response:
        return _reply(weight_routes.vllm_weight_info(weights))

    async def rl_abort_requests() -> Response:
        return _reply(weight_routes.vllm_abort_requests(weights, await _raw_body()))

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
