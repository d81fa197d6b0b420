"""Chat templates shipped with the package (``--chat-template chatml|qwen3``).

They live here, not in the emulator wing, because the server loads them by name;
the emulator and the bundled test tokenizer use them too.
"""

from __future__ import annotations

import importlib.resources
from typing import Final

__all__ = ["BUILTIN_TEMPLATES", "builtin_template"]

BUILTIN_TEMPLATES: Final = ("chatml", "qwen3")


def builtin_template(name: str) -> str:
    """Return the text of a chat template shipped with the package."""
    if name not in BUILTIN_TEMPLATES:
        raise ValueError(f"unknown built-in chat template {name!r}")
    ref = importlib.resources.files("rollout_session.prompt") / "templates" / f"{name}.jinja"
    return ref.read_text(encoding="utf-8")
