"""Command line of the emulator (wired as ``rollout-session emulator``): SGLang or vLLM.

Owns the flags (one per `EmulatorConfig` field, defaults taken from it, each
engine's server flags spelt as that engine spells them), their translation
into a config, and running one emulator on hypercorn until SIGINT/SIGTERM.
``--tool-call-parser`` and ``--reasoning-parser`` are both engines' flags,
taking the engine's own names (checked by `EmulatorConfig` once the engine
is known).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from pathlib import Path
from typing import Any

import trio

from rollout_session.emulator.config import ENGINES, EmulatorConfig
from rollout_session.emulator.faults import FAULTS
from rollout_session.emulator.tokenizer import BUILTIN_TEMPLATES

__all__ = ["ENGINES", "add_arguments", "config_from_args", "run"]

# `--engine`: SGLang serves every route of it at once (its chat route,
# /generate, the parse and session routes); vLLM its token-in/token-out
# route (/inference/v1/generate) with its server flags below.


def _engine(value: str) -> str:
    if value not in ENGINES:
        raise argparse.ArgumentTypeError(f"engine must be one of: {', '.join(ENGINES)}")
    return value


def _json_object(value: str) -> Any:
    """A JSON flag's value (SGLang: ``type_parser=json.loads``; vLLM:
    ``engine/arg_utils.py`` ``parse_type(json.loads)``)."""
    try:
        return json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"Value {value} cannot be parsed as JSON: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the emulator's flags to ``parser``."""
    d: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EmulatorConfig) if f.init}
    add = parser.add_argument
    add(
        "--engine",
        type=_engine,
        default=ENGINES[0],
        metavar="{sglang,vllm}",
        help="the inference engine spoken: sglang (default; every SGLang route at once: "
        "/v1/chat/completions, /generate, the parse and session routes) or vllm (vLLM "
        "0.33's /inference/v1/generate, /v1/models, /health, /version)",
    )
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=30000, help="port to bind, 0 = any free (default: %(default)s)")
    add("--tokenizer", type=Path, help="HF tokenizer directory (default: the bundled test one)")
    add("--model-name", default=d["model_name"], help="served model name (default: %(default)s)")
    add(
        "--chat-template",
        help=f"chat template: a built-in name ({', '.join(BUILTIN_TEMPLATES)}) or a .jinja file "
        "(default: the tokenizer's own)",
    )
    add("--seed", type=int, default=d["seed"], help="generation and fault seed")
    add("--context-length", type=int, default=d["context_length"], help="max prompt + completion")
    add("--base-latency-s", type=float, default=d["base_latency_s"], help="fixed latency per call")
    add("--prefill-s-per-token", type=float, default=d["prefill_s_per_token"],
        help="latency per uncached prompt token")  # fmt: skip
    add("--decode-s-per-token", type=float, default=d["decode_s_per_token"],
        help="latency per sampled token")  # fmt: skip
    add("--gpu-contention", action="store_true",
        help="one GPU per worker: prefill serialised (FIFO) and stalling the batched "
        "decode of other requests; default: every request's latency is independent")  # fmt: skip
    add("--cache-capacity-tokens", type=int, default=d["cache_capacity_tokens"],
        help="prefix-cache capacity in tokens, 0 disables it (default: %(default)s)")  # fmt: skip
    add("--cache-block-tokens", type=int, default=d["cache_block_tokens"],
        help="prefix-cache granularity in tokens (default: %(default)s)")  # fmt: skip
    add("--reasoning", action="store_true", help="answer with <think> blocks (Qwen3-style)")
    add("--completion-tokens", type=int, default=d["completion_tokens"],
        help="exact sampled tokens per text answer (default: 8..24 by seed)")  # fmt: skip
    add("--routed-experts-layers", type=int, default=d["routed_experts_layers"],
        help="layers in routed_experts (bytes = positions x layers x top-k x 4)")  # fmt: skip
    add("--routed-experts-top-k", type=int, default=d["routed_experts_top_k"],
        help="experts per token and layer in routed_experts")  # fmt: skip
    add("--routed-experts-num-experts", type=int, default=d["routed_experts_num_experts"],
        help="expert ids are in [0, N)")  # fmt: skip
    add("--fault", choices=FAULTS, help="inject this fault into completions (chat or generate)")
    add("--fault-rate", type=float, default=d["fault_rate"],
        help="fraction of completions that get --fault (default: %(default)s)")  # fmt: skip
    add("--weight-version", default=d["weight_version"], help="reported weight_version")
    add("--record-limit", type=int, default=d["record_limit"],
        help="chat requests kept for inspection (default: %(default)s)")  # fmt: skip
    add(
        "--tool-call-parser",
        metavar="NAME",
        help="the engine's tool-call parser, in the engine's names (SGLang: qwen25, hermes, "
        "llama3, ...; vLLM: hermes, ..., with --enable-auto-tool-choice); default: none",
    )
    add(
        "--reasoning-parser",
        metavar="NAME",
        help="the engine's reasoning parser, in the engine's names (qwen3, deepseek-r1, ...); "
        "default: none",
    )
    sglang = parser.add_argument_group("SGLang server flags (--engine sglang; SGLang's own names)")
    sglang.add_argument(
        "--enable-streaming-session",
        action="store_true",
        help="accept /open_session with streaming: true",
    )
    sglang.add_argument(
        "--enable-session-radix-cache",
        action="store_true",
        help="session ids reference their KV; eviction takes unreferenced KV first",
    )
    sglang.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="no tokenizer: /generate takes input_ids only and answers ids without text",
    )
    sglang.add_argument(
        "--preferred-sampling-params",
        type=_json_object,
        metavar="JSON",
        help="a JSON object of sampling parameters under every request's (and in /model_info)",
    )
    vllm = parser.add_argument_group("vLLM server flags (--engine vllm; vLLM's own names)")
    vllm.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve /inference/v1/generate and /inference/v1/abort_requests (off: 403, as vLLM)",
    )
    vllm.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="with --tool-call-parser (each requires the other): derender extracts tool calls",
    )
    vllm.add_argument(
        "--generation-config",
        default=d["generation_config"],
        metavar="{auto,vllm,FOLDER}",
        help="where the chat defaults come from: the model's generation_config.json (auto), "
        "none (vllm) or FOLDER's (default: %(default)s)",
    )
    vllm.add_argument(
        "--override-generation-config",
        type=_json_object,
        metavar="JSON",
        help="a JSON object over the generation config, e.g. '{\"temperature\": 0.6}'",
    )
    vllm.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens in every answer",
    )
    vllm.add_argument(
        "--dev-mode",
        action="store_true",
        help="as vLLM with VLLM_SERVER_DEV_MODE=1: serve the RL routes (/pause, /resume, "
        "/is_paused, /update_weight_version, /weight_info, /abort_requests)",
    )
    vllm.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="routed_experts (base64 .npy) in every answer; vLLM's default is off "
        "(the SGLang emulator always has them)",
    )


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """The config the flags describe; raises ValueError for invalid values."""
    from rollout_session.prompt.tokenizer import read_chat_template

    template = read_chat_template(args.chat_template) if args.chat_template else None
    extra = {} if args.tokenizer is None else {"tokenizer_path": args.tokenizer}
    if args.engine == "vllm":
        # vLLM (entrypoints/common/cli_args.py validate_parsed_serve_args):
        # --enable-auto-tool-choice requires --tool-call-parser. The emulator
        # also requires the converse: a tool parser is only ever active with
        # auto tool choice (parser/parser_manager.py get_tool_parser).
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if args.tool_call_parser and not args.enable_auto_tool_choice:
            raise ValueError(
                "--tool-call-parser requires --enable-auto-tool-choice (without it vLLM runs "
                "no tool parser)"
            )
    elif args.enable_auto_tool_choice:  # SGLang has no such flag
        raise ValueError(f"enable_auto_tool_choice is a flag of engine 'vllm', not {args.engine!r}")
    return EmulatorConfig(
        **extra,
        engine=args.engine,
        enable_scale_out=args.enable_scale_out,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        dev_mode=args.dev_mode,
        # None: the engine's default (on for SGLang, off for vLLM).
        return_routed_experts=True if args.enable_return_routed_experts else None,
        model_name=args.model_name,
        chat_template=template,
        seed=args.seed,
        context_length=args.context_length,
        base_latency_s=args.base_latency_s,
        prefill_s_per_token=args.prefill_s_per_token,
        decode_s_per_token=args.decode_s_per_token,
        gpu_contention=args.gpu_contention,
        cache_capacity_tokens=args.cache_capacity_tokens,
        cache_block_tokens=args.cache_block_tokens,
        reasoning=args.reasoning,
        completion_tokens=args.completion_tokens,
        routed_experts_layers=args.routed_experts_layers,
        routed_experts_top_k=args.routed_experts_top_k,
        routed_experts_num_experts=args.routed_experts_num_experts,
        fault=args.fault,
        fault_rate=args.fault_rate,
        weight_version=args.weight_version,
        enable_streaming_session=args.enable_streaming_session,
        enable_session_radix_cache=args.enable_session_radix_cache,
        skip_tokenizer_init=args.skip_tokenizer_init,
        preferred_sampling_params=args.preferred_sampling_params,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        record_limit=args.record_limit,
    )


async def _serve(config: EmulatorConfig, host: str, port: int) -> None:
    # SIGINT/SIGTERM shut the server down gracefully instead of unwinding
    # through the nursery as a KeyboardInterrupt traceback.
    from rollout_session.emulator.app import start_emulator

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            server, _ = await start_emulator(nursery, config, host=host, port=port)
            kind = "vLLM" if config.engine == "vllm" else "SGLang"
            print(f"{kind} emulator listening on {server.url}", flush=True)
            async for _ in signals:
                await server.aclose()
                break


def run(args: argparse.Namespace) -> None:
    """Serve one emulator until SIGINT (Ctrl-C) or SIGTERM."""
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        sys.exit(f"error: {exc}")
    trio.run(_serve, config, args.host, args.port)
