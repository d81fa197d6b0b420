"""The SGLang 0.5.23 facts the emulator's configuration needs: its version,
the parser names it registers and how its launch resolves them.

Its own module (no imports) so that `EmulatorConfig` and the emulator's
command line can check SGLang flags without loading the emulator. Paths
below are under ``sglang/srt/`` in the 0.5.23 wheel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = [
    "DEPRECATED_TOOL_CALL_PARSERS",
    "REASONING_PARSERS",
    "SGLANG_VERSION",
    "TOOL_CALL_PARSERS",
    "invalid_choice",
    "resolved_tool_call_parser",
    "unmodelled_parser",
]

# What /server_info reports as `version` (``sglang/version.py``).
SGLANG_VERSION: Final = "0.5.23"

# ``function_call/parser_names.py`` ``TOOL_CALL_PARSER_NAMES`` (kept equal
# to ``function_call/function_call_parser.py``
# ``FunctionCallParser.ToolCallParserEnum`` by SGLang's own test): with
# ``"auto"`` first, the choices of ``--tool-call-parser``
# (``server_args.py`` ``ServerArgs.add_cli_args``).
TOOL_CALL_PARSERS: Final = (
    "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32",
    "deepseekv4", "deepseekv41", "dots", "glm", "glm45", "glm47", "gpt-oss", "k2_horizon",
    "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3", "mimo", "minicpm5", "mistral", "muse",
    "poolside_v1", "pythonic", "qwen", "qwen25", "qwen3_coder", "spark25", "step3",
    "step3p5", "minimax-m2", "minimax-m3", "nanbeige", "trinity", "interns1", "hermes",
    "hunyuan", "gigachat3", "gigachat35", "gemma4", "inkling", "iquest_q1",
    "response_template",
)  # fmt: skip

# ``parser/reasoning_parser_names.py`` ``REASONING_PARSER_NAMES`` (equal to
# ``parser/reasoning_parser.py`` ``ReasoningParser.DetectorMap``'s keys):
# with ``"auto"``, the choices of ``--reasoning-parser``.
REASONING_PARSERS: Final = (
    "apertus2509", "beam", "deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41",
    "dots", "glm45", "ling3", "hunyuan", "gpt-oss", "k2_horizon", "kimi", "kimi_k2",
    "kimi_k3", "mimo", "muse", "poolside_v1", "qwen3", "qwen3-thinking", "minimax",
    "minimax-append-think", "minimax-m3", "nanbeige", "step3", "step3p5", "mistral",
    "nemotron_3", "granite_thinking_parser", "interns1", "gemma4", "inkling", "iquest_q1",
    "cohere_command4", "gigachat35", "response_template",
)  # fmt: skip

# ``arg_groups/serving_hook.py`` ``handle_deprecated_args``: a deprecated
# tool-call parser name is resolved to its successor (logged), and the
# resolved name is what the chat route runs and ``/server_info`` and
# ``/model_info`` report (``server_args.py`` ``ServerArgs.resolved_dict``,
# ``TokenizerManager.config_value``).
DEPRECATED_TOOL_CALL_PARSERS: Final = {"qwen25": "qwen", "glm45": "glm"}

# Tool-call parsers that switch SGLang's chat route to a Python chat encoder,
# which renders and parses on its own (``entrypoints/openai/chat_encoding.py``
# ``resolve_chat_encoding_spec``: deepseekv32 → dsv32, deepseekv4 → dsv4,
# deepseekv41 → dsv41, kimi_k3 → kimi_k3).
_ENCODER_TOOL_PARSERS: Final = frozenset({"deepseekv32", "deepseekv4", "deepseekv41", "kimi_k3"})


def invalid_choice(flag: str, value: str, choices: Sequence[str]) -> str:
    """argparse's refusal of a value outside ``choices`` (SGLang's parser
    flags are plain ``choices=["auto"] + names``)."""
    listed = ", ".join(repr(c) for c in ("auto", *choices))
    return f"argument {flag}: invalid choice: {value!r} (choose from {listed})"


def unmodelled_parser(flag: str, value: str) -> str | None:
    """Why the emulator does not serve an SGLang worker launched with
    ``flag value`` (a name SGLang accepts), or None when it does."""
    if value == "auto":
        return (
            f"the emulator does not model {flag} auto (SGLang detects the parser from the chat "
            "template or the checkpoint: parser/template_detection.py resolve_auto_parsers); "
            "name the parser"
        )
    if value == "response_template":
        return (
            f"the emulator does not model {flag} response_template (it needs the tokenizer's "
            "response_template configuration: parser/response_template.py)"
        )
    if flag == "--tool-call-parser" and value in _ENCODER_TOOL_PARSERS:
        return (
            f"the emulator does not model --tool-call-parser {value}: SGLang's chat route then "
            "renders and parses with its Python chat encoder "
            "(entrypoints/openai/chat_encoding.py resolve_chat_encoding_spec)"
        )
    return None


def resolved_tool_call_parser(name: str | None) -> str | None:
    """The tool-call parser an SGLang worker launched with ``name`` runs and
    reports (`DEPRECATED_TOOL_CALL_PARSERS`)."""
    return None if name is None else DEPRECATED_TOOL_CALL_PARSERS.get(name, name)
