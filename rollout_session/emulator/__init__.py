"""The emulator wing: SGLang and vLLM workers with no GPU, and the bundled test tokenizers.

Names are imported on first use, so a command that only describes the
emulator's flags does not load the emulator (transformers, Quart).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_session._lazy import lazy_attributes

if TYPE_CHECKING:
    from rollout_session.emulator.app import create_emulator_app, start_emulator
    from rollout_session.emulator.config import EmulatorConfig
    from rollout_session.emulator.faults import FAULT_HEADER, FAULTS
    from rollout_session.emulator.model.generation import TextModel
    from rollout_session.emulator.records import ChatRecord
    from rollout_session.emulator.tokenizer import (
        BUILTIN_TEMPLATES,
        FamilyTokens,
        builtin_template,
        bundled_tokenizer_path,
        family_tokenizer_path,
    )
    from rollout_session.emulator.worker import Emulator

__all__ = [
    "BUILTIN_TEMPLATES",
    "FAULTS",
    "FAULT_HEADER",
    "ChatRecord",
    "Emulator",
    "EmulatorConfig",
    "FamilyTokens",
    "TextModel",
    "builtin_template",
    "bundled_tokenizer_path",
    "create_emulator_app",
    "family_tokenizer_path",
    "start_emulator",
]

_HOME = {
    "BUILTIN_TEMPLATES": ".tokenizer",
    "FAULTS": ".faults",
    "FAULT_HEADER": ".faults",
    "ChatRecord": ".records",
    "Emulator": ".worker",
    "EmulatorConfig": ".config",
    "FamilyTokens": ".tokenizer",
    "TextModel": ".model.generation",
    "builtin_template": ".tokenizer",
    "bundled_tokenizer_path": ".tokenizer",
    "create_emulator_app": ".app",
    "family_tokenizer_path": ".tokenizer",
    "start_emulator": ".app",
}

__getattr__, __dir__ = lazy_attributes(__name__, _HOME, __all__)
