"""`EmulatorConfig`: everything an emulator does, validated on construction.

Its own module so that the emulator's command line can describe its flags
without importing the emulator (transformers, Quart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from rollout_session.testing.faults import FAULTS
from rollout_session.testing.tokenizer import bundled_tokenizer_path

__all__ = ["EmulatorConfig"]


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything an emulator does; latencies in seconds, sizes in tokens."""

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
    # when the flag is off (its meta_info then lacks the key).
    return_routed_experts: bool = True
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
    # Chat requests kept in `Emulator.requests` (oldest dropped first); long
    # benchmarks keep this small since bodies carry whole prompts.
    record_limit: int = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer_path", Path(self.tokenizer_path))
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
