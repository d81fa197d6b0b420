"""SGLang 0.5.23's HTTP routes over an `Emulator`: thin Quart adapters.

Owns `add_sglang_routes`: ``/health``, ``/get_model_info`` and
``/model_info`` (``srt/entrypoints/http_server.py`` ``model_info``),
``/server_info`` and ``/get_server_info``, ``/v1/models``,
``/v1/chat/completions`` (`chat`), ``/generate`` (`generate`),
``/parse_function_call`` and ``/separate_reasoning`` (`worker`),
``/open_session`` and ``/close_session`` (`session_routes`), the weight
routes (`weight_routes`) and ``/emulator/stats``. What a call does is
the handler's job; this module only moves bytes and status codes between
it and HTTP.
"""

from __future__ import annotations

import time

from quart import Response, request
from quart_trio import QuartTrio

from rollout_session.emulator.faults import FAULT_HEADER
from rollout_session.emulator.http_io import json_response, raw_body, reply_response
from rollout_session.emulator.sglang import session_routes, weight_routes
from rollout_session.emulator.sglang.chat import handle_chat
from rollout_session.emulator.sglang.generate import handle_generate
from rollout_session.emulator.sglang.names import SGLANG_VERSION
from rollout_session.emulator.sglang.worker import SglangWorker
from rollout_session.emulator.worker import Emulator

__all__ = ["SGLANG_VERSION", "add_sglang_routes"]


def add_sglang_routes(app: QuartTrio, emulator: Emulator) -> None:
    """SGLang 0.5.23's routes (and nothing of vLLM's) over ``emulator``."""
    config = emulator.config
    worker = SglangWorker(emulator)

    weights = emulator.weights

    async def health() -> Response:
        return json_response({})

    async def model_info() -> Response:
        # http_server.model_info (and /get_model_info, its deprecated alias):
        # the tokenizer manager's live model path, served name, load format
        # and weight version (moved by weight updates), and the launch's
        # resolved parsers and preferred sampling parameters. model_type and
        # architectures are the model config's: the emulator serves none.
        return json_response(
            {
                "model_path": weights.model_path,
                "served_model_name": weights.model_path,
                "tokenizer_path": str(config.tokenizer_path),
                "is_generation": True,
                "preferred_sampling_params": config.preferred_sampling_params,
                "weight_version": weights.reported_version,
                "load_format": weights.load_format,
                "reasoning_parser": worker.reasoning_parser,
                "tool_call_parser": worker.tool_call_parser,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": None,
                "architectures": None,
            }
        )

    async def server_info() -> Response:
        # SGLang's /server_info (and /get_server_info, its deprecated alias)
        # is its resolved server args (flat, by field name: ServerArgs.resolved_dict,
        # a deprecated tool-call parser name resolved) plus live scheduler
        # state and `version`; these are the fields the emulator models. Its
        # weight_version is the launch one: a weight update moves
        # /model_info's, not this.
        return json_response(
            {
                "model_path": config.model_name,
                "tokenizer_path": str(config.tokenizer_path),
                "skip_tokenizer_init": config.skip_tokenizer_init,
                "served_model_name": config.model_name,
                "reasoning_parser": worker.reasoning_parser,
                "tool_call_parser": worker.tool_call_parser,
                "preferred_sampling_params": config.preferred_sampling_params,
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
        return json_response({"object": "list", "data": [model]})

    async def chat() -> Response:
        raw = await raw_body()
        headers = {name.lower(): value for name, value in request.headers.items()}
        return reply_response(
            await handle_chat(worker, raw, request.headers.get(FAULT_HEADER), headers)
        )

    async def generate() -> Response:
        return reply_response(await handle_generate(worker, await raw_body()))

    async def parse_function_call() -> Response:
        return reply_response(worker.parse_function_call(await raw_body()))

    async def separate_reasoning() -> Response:
        return reply_response(worker.separate_reasoning(await raw_body()))

    async def open_session() -> Response:
        # SGLang answers with the session id as a JSON string.
        return reply_response(session_routes.open_session(emulator, await raw_body()))

    async def close_session() -> Response:
        reply = session_routes.close_session(emulator, await raw_body())
        if reply.status == 200:
            return Response(b"", 200)  # SGLang: Response(status_code=200), no body
        return reply_response(reply)

    async def stats() -> Response:
        return json_response(emulator.stats())

    # Weight updates, pauses, aborts (`weight_routes`, ``weights``).
    async def update_weight_version() -> Response:
        return reply_response(weight_routes.sglang_update_weight_version(weights, await raw_body()))

    async def update_weights_from_disk() -> Response:
        raw = await raw_body()
        return reply_response(await weight_routes.sglang_update_weights_from_disk(weights, raw))

    async def pause_generation() -> Response:
        return reply_response(
            await weight_routes.sglang_pause_generation(weights, await raw_body())
        )

    async def continue_generation() -> Response:
        return reply_response(weight_routes.sglang_continue_generation(weights, await raw_body()))

    async def abort_request() -> Response:
        return reply_response(weight_routes.sglang_abort_request(weights, await raw_body()))

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
