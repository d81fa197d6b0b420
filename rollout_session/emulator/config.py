"""`EmulatorConfig`: everything an emulator does, validated on construction.

Its own module so that the emulator's command line can describe its flags
without importing the emulator (transformers, Quart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_session.emulator.faults import FAULTS
from rollout_session.emulator.sglang.launch import check_sglang_launch
from rollout_session.emulator.tokenizer import bundled_tokenizer_path
from rollout_session.emulator.vllm.generation_config import check_override
from rollout_session.emulator.vllm.names import VLLM_REASONING_PARSERS, VLLM_TOOL_PARSERS

__all__ = ["ENGINES", "EmulatorConfig"]

# The engines the emulator speaks: SGLang (every route of it at once) or
# vLLM (its token-in/token-out route, `vllm.generate`).
ENGINES = ("sglang", "vllm")


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything an emulator does; latencies in seconds, sizes in tokens."""

    # "sglang" (SGLang's routes) or "vllm" (vLLM 0.33's routes only; docs/emulator.md).
    engine: str = "sglang"
    tokenizer_path: Path = field(default_factory=bundled_tokenizer_path)
    model_name: str = "rollout-session/emulator"
    # Chat template text used instead of the tokenizer's own (e.g. builtin_template("qwen3")).
    chat_template: str | None = None
    seed: int = 0
    context_length: int = 32768
    base_latency_s: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0
    # One GPU per worker: serialised prefill that stalls batched decode (see `gpu`).
    gpu_contention: bool = False
    cache_capacity_tokens: int = 1 << 20
    cache_block_tokens: int = 16
    reasoning: bool = False
    # Exact number of sampled tokens (end token included) of text answers;
    # None: 8..24, varied by seed.
    completion_tokens: int | None = None
    # Like SGLang started with --enable-return-routed-experts (a MoE model).
    # False: asked for routed experts, the answer has none, as SGLang's
    # when the flag is off (its meta_info then lacks the key). With vLLM:
    # its --enable-return-routed-experts (every answer carries them).
    # None (the default): the engine's own default, on for the SGLang
    # emulator, off for vLLM's (resolved to a bool on construction).
    return_routed_experts: bool | None = None
    routed_experts_layers: int = 4
    routed_experts_top_k: int = 2
    routed_experts_num_experts: int = 64
    fault: str | None = None
    fault_rate: float = 1.0
    weight_version: str = "default"
    # SGLang's --enable-streaming-session (off by default, as in SGLang):
    # /open_session with streaming: true is refused without it.
    enable_streaming_session: bool = False
    # SGLang's --enable-session-radix-cache (off by default, as in SGLang):
    # requests' session ids reference their KV in the prefix cache, which
    # evicts unreferenced blocks first; without it session ids are ignored.
    enable_session_radix_cache: bool = False
    # vLLM's --enable-scale-out (off by default, as in vLLM): without it
    # /inference/v1/generate (and every scale-out path) answers 403.
    enable_scale_out: bool = False
    # The engine's --tool-call-parser NAME, in the engine's own names; None:
    # no tool parser (both engines' default). SGLang: a name of
    # FunctionCallParser.ToolCallParserEnum (sglang.names; a deprecated one,
    # qwen25 or glm45, runs and is reported as its successor). vLLM: a name
    # vLLM registers, with --enable-auto-tool-choice (implied).
    tool_call_parser: str | None = None
    # The engine's --reasoning-parser NAME (SGLang's ReasoningParser.DetectorMap
    # names, or vLLM's); None: no reasoning parser.
    reasoning_parser: str | None = None
    # SGLang's --skip-tokenizer-init (off by default, as in SGLang): no
    # tokenizer, so /generate answers ids without text, text prompts and
    # stop strings are refused and the chat route cannot answer.
    skip_tokenizer_init: bool = False
    # SGLang's --preferred-sampling-params (a JSON object; None: unset):
    # merged under every request's sampling parameters, published by
    # /model_info and /server_info.
    preferred_sampling_params: dict[str, Any] | None = None
    # vLLM's --generation-config: "auto" (the model directory's
    # generation_config.json), "vllm" (none) or a folder holding one.
    generation_config: str = "auto"
    # vLLM's --override-generation-config (a JSON object; None: {}).
    override_generation_config: dict[str, Any] | None = None
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.
    enable_prompt_tokens_details: bool = False
    # vLLM started with VLLM_SERVER_DEV_MODE=1 (off by default, as in vLLM):
    # the RL routes (/pause, /resume, /is_paused, /update_weight_version,
    # /weight_info, /abort_requests) are served; without it they are 404.
    dev_mode: bool = False
    # Chat requests kept in `Emulator.requests` (oldest dropped first); long
    # benchmarks keep this small since bodies carry whole prompts.
    record_limit: int = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer_path", Path(self.tokenizer_path))
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        vllm = self.engine == "vllm"
        if self.return_routed_experts is None:
            object.__setattr__(self, "return_routed_experts", not vllm)
        self._check_engine_flags(vllm)
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        for name in ("base_latency_s", "prefill_s_per_token", "decode_s_per_token"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        positive = ("context_length", "cache_block_tokens", "routed_experts_layers")
        for name in (*positive, "routed_experts_top_k", "routed_experts_num_experts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.routed_experts_num_experts > 2**31:
            raise ValueError("routed_experts_num_experts must fit in int32")
        if self.cache_capacity_tokens < 0 or self.record_limit < 0:
            raise ValueError("cache_capacity_tokens and record_limit must be >= 0")
        if self.completion_tokens is not None and self.completion_tokens < 1:
            raise ValueError("completion_tokens must be >= 1 or None")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; known: {', '.join(FAULTS)}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be in [0, 1], got {self.fault_rate!r}")

    def _check_engine_flags(self, vllm: bool) -> None:
        """Each engine's server flags only with that engine, checked as that
        engine checks them at launch; the parser names in the engine's own
        registry (SGLang: `sglang.launch`; vLLM: ``tool_parsers/__init__.py``,
        ``reasoning/__init__.py``)."""
        sglang_only = (
            "enable_streaming_session",
            "enable_session_radix_cache",
            "skip_tokenizer_init",
            "preferred_sampling_params",
        )
        vllm_only = (
            "enable_scale_out",
            "enable_prompt_tokens_details",
            "dev_mode",
            "override_generation_config",
        )
        for name in sglang_only if vllm else vllm_only:
            if getattr(self, name) not in (None, False):
                other = "sglang" if vllm else "vllm"
                raise ValueError(f"{name} is a flag of engine {other!r}, not {self.engine!r}")
        if not vllm and self.generation_config != "auto":
            raise ValueError(f"generation_config is a flag of engine 'vllm', not {self.engine!r}")
        if not vllm:
            check_sglang_launch(
                self.tool_call_parser,
                self.reasoning_parser,
                self.preferred_sampling_params,
                self.skip_tokenizer_init,
            )
            return
        if self.routed_experts_num_experts > 1 << 16:
            raise ValueError("routed_experts_num_experts must fit in uint16 (vLLM's dtype)")
        if not self.generation_config:
            raise ValueError("generation_config must be auto, vllm or a folder")
        if self.override_generation_config is not None:
            check_override(self.override_generation_config)
        if self.tool_call_parser is not None and self.tool_call_parser not in VLLM_TOOL_PARSERS:
            raise ValueError(
                f"invalid tool call parser: {self.tool_call_parser} "
                f"(choose from {', '.join(sorted(VLLM_TOOL_PARSERS))})"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in (
            VLLM_REASONING_PARSERS
        ):
            raise ValueError(
                f"invalid reasoning parser: {self.reasoning_parser} "
                f"(choose from {', '.join(sorted(VLLM_REASONING_PARSERS))})"
            )
