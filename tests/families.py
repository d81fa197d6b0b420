"""The genuine chat templates of tests/fixtures/templates as servable model
directories: the bundled vocabulary with each family's template, BOS/EOS and
stop tokens (see that folder's README for sources and licences); and the
templates of more.json (`model_path`), which need what the families' builder
does not write: several named templates, markers the bundled vocabulary
lacks."""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from rollout_session.emulator import (
    FamilyTokens,
    TextModel,
    bundled_tokenizer_path,
    family_tokenizer_path,
)
from rollout_session.emulator.tokenizer import built_once
from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
_FACTS: dict[str, Any] = json.loads((TEMPLATES / "families.json").read_text("utf-8"))["families"]
FAMILIES: tuple[str, ...] = tuple(sorted(_FACTS))


def family_facts(family: str) -> dict[str, Any]:
    """The family's entry in families.json (SGLang parser names included)."""
    facts: dict[str, Any] = _FACTS[family]
    return facts


def sglang_parsers(family: str) -> dict[str, Any]:
    """The SGLang parsers a worker serving `family` is launched with
    (families.json ``sglang_tool_call_parser``/``sglang_reasoning_parser``),
    as `EmulatorConfig` fields: SGLang's chat route parses only with them."""
    facts = _FACTS[family]
    names = {
        "tool_call_parser": facts.get("sglang_tool_call_parser"),
        "reasoning_parser": facts.get("sglang_reasoning_parser"),
    }
    return {field: name for field, name in names.items() if name}


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


# Genuine templates beyond the families (more.json): several named templates
# in one tokenizer, a template that renders only with tools, one that ends
# every last turn with a generation prompt, one that drops tool messages.
_MORE: dict[str, Any] = json.loads((TEMPLATES / "more.json").read_text("utf-8"))["models"]
MORE: tuple[str, ...] = tuple(sorted(_MORE))
_PLACEHOLDER = "<｜place▁holder"


def _more_files(name: str) -> tuple[dict[str, Any], dict[str, str]]:
    facts: dict[str, Any] = _MORE[name]
    templates = {k: (TEMPLATES / f).read_text("utf-8") for k, f in facts["templates"].items()}
    return facts, templates


def _build_more(target: Path, facts: dict[str, Any], templates: dict[str, str]) -> None:
    spec = json.loads((bundled_tokenizer_path() / "tokenizer.json").read_text("utf-8"))
    added = spec["added_tokens"]
    present = {tok["content"] for tok in added}
    # Unused placeholders from the top down: the bundled list renames from
    # the bottom up, so the two never meet.
    free = sorted(
        (tok for tok in added if tok["content"].startswith(_PLACEHOLDER)),
        key=lambda tok: -tok["id"],
    )
    missing = [m for m in facts["markers"] if m not in present]
    for marker, tok in zip(missing, free, strict=False):
        tok.update(content=marker, special=True, normalized=False)
    ids = {tok["content"]: tok["id"] for tok in added}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": facts["bos_token"],
        "eos_token": facts["eos_token"],
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    target.mkdir(parents=True)
    if len(templates) > 1:  # transformers' list form, as the model repositories write it
        config["chat_template"] = [{"name": k, "template": t} for k, t in templates.items()]
    else:
        [template] = templates.values()
        (target / "chat_template.jinja").write_text(template, "utf-8")
    stop = [ids[t] for t in facts["stop_tokens"]]
    (target / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), "utf-8")
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}), "utf-8")
    # Written last: its presence marks a complete directory.
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1), "utf-8")


@functools.cache
def model_path(name: str) -> Path:
    """A model directory for `name` in more.json (built once per content digest)."""
    facts, templates = _more_files(name)
    digest = hashlib.sha256(
        (bundled_tokenizer_path() / "tokenizer.json").read_bytes()
        + json.dumps([facts, templates], sort_keys=True).encode()
    ).hexdigest()[:16]
    final = Path(tempfile.gettempdir()) / f"rollout-session-model-{digest}"
    return built_once(
        final, "tokenizer_config.json", lambda target: _build_more(target, facts, templates)
    )


@functools.cache
def model_tokenizer(name: str, chat_template: str | None = None) -> ChatTokenizer:
    """`name`'s tokenizer, serving `chat_template` (as --chat-template) if given."""
    return load_tokenizer(model_path(name), chat_template)
