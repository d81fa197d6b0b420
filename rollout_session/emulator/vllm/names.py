"""The vLLM 0.33.0 facts the emulator's configuration needs: its version,
the parser names it registers, its logprobs cap.

Its own module (no imports) so that `EmulatorConfig` and the emulator's
command line can check vLLM flags without loading the emulator. Paths
below are under ``vllm/`` in the 0.33.0 wheel.
"""

from __future__ import annotations

from typing import Final, Literal, NamedTuple

__all__ = [
    "KIMI_TOOL_PARSERS",
    "RENDER_REASONING_PARSERS",
    "RENDER_TOOL_PARSERS",
    "VLLM_MAX_LOGPROBS",
    "VLLM_REASONING_PARSERS",
    "VLLM_TOOL_PARSERS",
    "VLLM_VERSION",
    "RenderReasoningParser",
    "RenderToolParser",
]

# `_version.py`: what GET /version answers.
VLLM_VERSION: Final = "0.33.0"

# `tool_parsers/__init__.py` `_TOOL_PARSERS_TO_REGISTER`: the names
# --tool-call-parser accepts (`validate_api_server_args`).
VLLM_TOOL_PARSERS: Final = frozenset(
    {
        "dots", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "deepseek_v41",
        "cohere_command3", "cohere_command4", "ernie45", "glm45", "glm47", "ling3",
        "granite-20b-fc", "granite", "granite4", "hermes", "hf", "beam", "poolside_v1",
        "hunyuan_a13b", "hy_v3", "hy_v4", "internlm", "jamba", "lfm2", "kimi_k2", "kimi_k3",
        "k2_horizon", "llama3_json", "llama4_json", "llama4_pythonic", "longcat", "mimo",
        "minimax_m2", "minimax_m3", "minicpm5", "mistral", "olmo3", "plamo3", "muse",
        "muse_glimmer", "musespark1x", "openai", "phi4_mini_json", "pythonic", "qwen3_coder",
        "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "step5", "inkling", "xlam",
        "gigachat3", "functiongemma", "gemma4", "apertus",
    }
)  # fmt: skip

# `reasoning/__init__.py` `_REASONING_PARSERS_TO_REGISTER`: the names
# --reasoning-parser accepts.
VLLM_REASONING_PARSERS: Final = frozenset(
    {
        "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "poolside_v1",
        "cohere_command3", "cohere_command4", "ernie45", "gemma4", "glm45", "glm47", "ling3",
        "openai_gptoss", "granite", "granite_thinking_parser", "hf", "beam", "holo2",
        "hunyuan_a13b", "hy_v3", "hy_v4", "kimi_k2", "kimi_k3", "k2_horizon", "mimo",
        "minicpmv", "minimax_m2", "minimax_m2_append_think", "minimax_m3", "mistral",
        "nemotron_v3", "olmo3", "plamo3", "muse", "muse_glimmer", "musespark1x", "qwen3",
        "seed_oss", "step3", "step3p5", "step5", "inkling",
    }
)  # fmt: skip

# Tool parsers of Kimi models, whose tool-call ids vLLM writes as
# ``functions.NAME:IDX`` (`renderers/chat_utils/tool_call.py`
# `get_tool_call_id_type` keys this on the model type; the emulator, which
# serves no real model, on the parser).
KIMI_TOOL_PARSERS: Final = frozenset({"kimi_k2", "kimi_k3"})

# `config/model.py` `max_logprobs` default (--max-logprobs 20): more sample
# logprobs are refused by `SamplingParams._validate_logprobs`.
VLLM_MAX_LOGPROBS: Final = 20


class RenderToolParser(NamedTuple):
    """What a tool parser's part of ``adjust_request`` does on the chat
    route and ``/v1/chat/completions/render`` (docs/research/
    vllm-0.33-generate-request.md §1, §3)."""

    # It has a `structural_tag_model` (tool_parsers/*.py): tool requests it
    # constrains get a structural tag (DelegatingParser._apply_structural_tag),
    # and with VLLM_ENFORCE_STRICT_TOOL_CALLING (the default) its
    # `supports_required_and_named` is False
    # (abstract_tool_parser.py ToolParser.__init_subclass__).
    structural_tag: bool
    # Its `default_tool_strict_level` is FUNCTION (glm47_moe_tool_parser.py):
    # every tool request but tool_choice "none" gets the tag.
    function_level: bool
    # `supports_required_and_named`: required/named get the JSON-array schema
    # of ToolParser.adjust_request (tool_parsers/utils.py get_json_schema_from_tools).
    json_schema: bool
    # When its adjust_request sets skip_special_tokens False: "always"
    # (engine parsers: ParserEngine.adjust_request), "with_tools" (tools and
    # tool_choice not "none": Hermes2ProToolParser, KimiK2ToolParser), "never".
    skip_special: Literal["always", "with_tools", "never"]


# The tool parsers whose adjust_request the emulator's render route models
# (a subset of VLLM_TOOL_PARSERS; with any other, render is refused).
RENDER_TOOL_PARSERS: Final = {
    "hermes": RenderToolParser(True, False, False, "with_tools"),
    "qwen3_json": RenderToolParser(True, False, False, "with_tools"),
    "longcat": RenderToolParser(True, False, False, "with_tools"),
    "kimi_k2": RenderToolParser(True, False, False, "with_tools"),
    "llama3_json": RenderToolParser(True, False, False, "never"),
    "llama4_json": RenderToolParser(True, False, False, "never"),
    "deepseek_v3": RenderToolParser(True, False, False, "never"),
    "deepseek_v31": RenderToolParser(True, False, False, "never"),
    "qwen3_coder": RenderToolParser(True, False, False, "always"),
    "qwen3_xml": RenderToolParser(True, False, False, "always"),
    "glm45": RenderToolParser(True, True, False, "always"),
    "glm47": RenderToolParser(True, True, False, "always"),
    "pythonic": RenderToolParser(False, False, True, "never"),
    "llama4_pythonic": RenderToolParser(False, False, True, "never"),
    "olmo3": RenderToolParser(False, False, True, "never"),
    "xlam": RenderToolParser(False, False, True, "never"),
    "phi4_mini_json": RenderToolParser(False, False, True, "never"),
}


class RenderReasoningParser(NamedTuple):
    """What a reasoning parser does on render: its adjust_request and its
    ``is_reasoning_end`` over the prompt (``reasoning_ended``)."""

    # Engine-based (parser/engine/adapters.py): adjust_request sets
    # skip_special_tokens False on every request.
    engine: bool
    # How it reads the prompt's reasoning state:
    # "think": BaseThinkingReasoningParser.is_reasoning_end (reasoning/basic_parsers.py);
    # "think_if_thinking": DeepSeekV3ReasoningParser (the identity parser,
    #   always ended, unless chat_template_kwargs thinking/enable_thinking);
    # "qwen3", "glm": ParserEngine.is_reasoning_end (parser/engine/parser_engine.py)
    #   with the family's config (parser/qwen3.py, parser/glm47_moe.py).
    reads: Literal["think", "think_if_thinking", "qwen3", "glm"]


RENDER_REASONING_PARSERS: Final = {
    "deepseek_r1": RenderReasoningParser(False, "think"),
    "deepseek_v3": RenderReasoningParser(False, "think_if_thinking"),
    "qwen3": RenderReasoningParser(True, "qwen3"),
    "glm45": RenderReasoningParser(True, "glm"),
    "glm47": RenderReasoningParser(True, "glm"),
}
