"""The genuine chat templates of tests/fixtures/templates as servable model
directories: the bundled vocabulary with each family's template, BOS/EOS and
stop tokens (see that folder's README for sources and licences)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer
from rollout_session.testing import FamilyTokens, TextModel, family_tokenizer_path

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
_FACTS: dict[str, Any] = json.loads((TEMPLATES / "families.json").read_text("utf-8"))["families"]
FAMILIES: tuple[str, ...] = tuple(sorted(_FACTS))


def family_facts(family: str) -> dict[str, Any]:
    """The family's entry in families.json (SGLang parser names included)."""
    facts: dict[str, Any] = _FACTS[family]
    return facts


def template_text(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text("utf-8")


def family_tokens(family: str) -> FamilyTokens:
    facts = _FACTS[family]
    return FamilyTokens(
        eos=facts["eos_token"], bos=facts["bos_token"], stop=tuple(facts["stop_tokens"])
    )


@functools.cache
def family_path(family: str) -> Path:
    """A model directory for `family` (built once per content digest)."""
    return family_tokenizer_path(template_text(family), family_tokens(family))


@functools.cache
def family_text_model(family: str) -> TextModel:
    """The emulator's word model over the family's tokenizer (loaded once;
    emulators share it)."""
    return TextModel(AutoTokenizer.from_pretrained(str(family_path(family))))


@functools.cache
def family_tokenizer(family: str) -> ChatTokenizer:
    return load_tokenizer(family_path(family))
