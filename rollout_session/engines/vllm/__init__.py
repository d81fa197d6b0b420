"""The ``vllm`` engine: vLLM's token-in/token-out ``/inference/v1/generate``
with ``output_mode: "derender"`` (vLLM samples and parses with its own
parsers in one call).

Owns: the chat route's translation (`request`), the workers' parser facts
(`parsers`), the answer's strict check (`answer`), the agent's reply
(`reply`), how the pool speaks to vLLM workers (`worker`), and the engine
(`engine`). May import the engines wing's shared modules and
`sglang_chat.answer`'s check vocabulary; nothing of SGLang's wire format.
"""

from __future__ import annotations

from .engine import VllmEngine
from .parsers import VllmParsers
from .request import VllmOptions, model_options
from .worker import VLLM_WORKERS

__all__ = ["VLLM_WORKERS", "VllmEngine", "VllmOptions", "VllmParsers", "model_options"]
