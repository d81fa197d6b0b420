"""``serve --demo``'s workers: SGLang or vLLM emulators started in-process.

The only module of `cli` that imports `rollout_session.emulator` (the
emulator), and only when workers start, so importing this module costs
nothing; `cli.main` and the fleets pass `start_demo_workers` to
`cli.run.run_server` when the settings ask for a demo.

An SGLang emulator serves every SGLang route at once (its chat route,
``/generate`` and the parse routes), so the demo runs under every SGLang
engine, ``auto`` included; ``--engine vllm`` gets vLLM emulators
(``--enable-scale-out``). The workers are launched as a trainer would
launch them, with the parsers of their chat template (`worker_parsers`:
the server's, where it names them), and the server learns them as it would
from real workers: SGLang's from ``/server_info``; vLLM publishes none, so
under ``vllm`` the server is given the same names (`demo_parsers`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Final

import trio

from ..config import Settings
from ..prompt.builtin import BUILTIN_TEMPLATES, builtin_template

__all__ = ["demo_parsers", "start_demo_workers", "worker_parsers"]

_log = logging.getLogger("rollout_session")

# Each kind of worker's parser names for the bundled templates: kind →
# built-in template → (--tool-call-parser, --reasoning-parser when the demo
# answers with reasoning). Both write Qwen's `<tool_call>` JSON; only qwen3
# renders reasoning (a `<think>` block), so ChatML's demo answers never
# carry one.
_TEMPLATE_PARSERS: Final = {
    "sglang": {"chatml": ("qwen25", None), "qwen3": ("qwen25", "qwen3")},
    "vllm": {"chatml": ("hermes", None), "qwen3": ("hermes", "qwen3")},
}


def _kind(settings: Settings) -> str:
    """The demo's kind of worker: vLLM's for ``--engine vllm``, else SGLang's."""
    return "vllm" if settings.engine == "vllm" else "sglang"


def _builtin_name(template: str) -> str | None:
    return next((n for n in BUILTIN_TEMPLATES if builtin_template(n) == template), None)


def _template_parsers(settings: Settings, template: str | None) -> tuple[str, str | None] | None:
    """The worker kind's names of the parsers a worker serving `template`
    (its text) is launched with (the reasoning parser only with
    ``--demo-reasoning``), or None for a template the demo does not know."""
    name = None if template is None else _builtin_name(template)
    if name is None:
        return None
    tool_call, reasoning = _TEMPLATE_PARSERS[_kind(settings)][name]
    return tool_call, reasoning if settings.demo_reasoning else None


def worker_parsers(settings: Settings, template: str | None) -> tuple[str | None, str | None]:
    """The (--tool-call-parser, --reasoning-parser) the demo's workers are
    launched with: the server's where it names them, else those of the
    workers' template (`template`: its text), or none for a template the
    demo does not know."""
    if settings.tool_call_parser or settings.reasoning_parser:
        return settings.tool_call_parser, settings.reasoning_parser
    return _template_parsers(settings, template) or (None, None)


def demo_parsers(settings: Settings, template: str | None) -> Settings:
    """`settings`, under ``--engine vllm`` with no parser named, with the
    parsers of the demo's chat template (`template`: its text, None when
    unknown), logged: vLLM workers do not publish theirs. A template the demo
    does not know gets none, and a warning: its answers then come back
    unparsed (and vLLM refuses tools)."""
    if _kind(settings) != "vllm" or settings.tool_call_parser or settings.reasoning_parser:
        return settings
    parsers = _template_parsers(settings, template)
    if parsers is None:
        _log.warning(
            "serve --demo --engine vllm: no parsers known for this chat template; tool calls "
            "and reasoning come back as text unless --tool-call-parser and "
            "--reasoning-parser name them"
        )
        return settings
    tool_call, reasoning = parsers
    _log.info(
        "demo: --engine vllm with --tool-call-parser %s and --reasoning-parser %s "
        "(vLLM's names for the %s chat template%s)",
        tool_call,
        reasoning or "none",
        _builtin_name(template or ""),
        ", with --demo-reasoning" if reasoning else "",
    )
    return replace(settings, tool_call_parser=tool_call, reasoning_parser=reasoning)


def _tokenizer_template(tokenizer: str) -> str | None:
    """The tokenizer directory's own template, if it keeps it as a file."""
    try:
        return (Path(tokenizer) / "chat_template.jinja").read_text(encoding="utf-8")
    except OSError:
        return None


async def start_demo_workers(nursery: trio.Nursery, settings: Settings) -> Settings:
    """Emulator workers speaking the served tokenizer and template (the
    bundled test tokenizer and its ChatML template unless given); the
    settings with their URLs added (and, for ``vllm``, the template's
    parsers: `demo_parsers`). Without the ``demo`` extra, exits naming it."""
    try:
        from ..emulator.app import start_emulator
        from ..emulator.config import EmulatorConfig
        from ..emulator.tokenizer import bundled_tokenizer_path
    except ImportError as exc:
        raise SystemExit(
            f"serve --demo needs the demo extra ({exc}): pip install 'rollout-session[demo]'"
        ) from None
    from ..prompt.tokenizer import read_chat_template

    tokenizer = settings.tokenizer or str(bundled_tokenizer_path())
    try:
        template = read_chat_template(settings.chat_template) if settings.chat_template else None
    except OSError as exc:
        # The emulator workers render one template they read as text.
        raise SystemExit(
            f"serve --demo takes --chat-template as a file or a built-in (chatml, qwen3), "
            f"not a named template of the tokenizer: {exc}"
        ) from None
    served = template or _tokenizer_template(tokenizer)
    settings = demo_parsers(settings, served)
    tool_call_parser, reasoning_parser = worker_parsers(settings, served)
    urls = list(settings.workers)
    teachers = list(settings.teacher_workers)
    vllm = _kind(settings) == "vllm"
    # The workers, then (unless --teacher-worker names some) one teacher: an
    # emulator with a seed of its own, so it scores the same tokens
    # differently (rescore target "teacher").
    for i in range(settings.demo_workers + (0 if teachers else 1)):
        teacher = i == settings.demo_workers
        config = EmulatorConfig(
            seed=1000 if teacher else i,
            tokenizer_path=Path(tokenizer),
            chat_template=template,
            reasoning=settings.demo_reasoning,
            # vLLM's workers: the token-in/token-out route on, no routed
            # experts (vLLM's default). Both engines' with their parsers.
            engine="vllm" if vllm else "sglang",
            enable_scale_out=vllm,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            return_routed_experts=not vllm or settings.routed_experts,
        )
        running, _ = await start_emulator(nursery, config, host="127.0.0.1")
        kind = "vLLM" if vllm else "SGLang"
        if teacher:
            print(f"demo {kind} emulator teacher on {running.url}", flush=True)
            teachers.append(running.url)
        else:
            print(f"demo {kind} emulator worker {i} on {running.url}", flush=True)
            urls.append(running.url)
    return replace(
        settings, workers=tuple(urls), teacher_workers=tuple(teachers), tokenizer=tokenizer
    )
