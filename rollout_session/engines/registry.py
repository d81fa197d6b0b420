"""The engines: name → `EngineSpec`. The one module that names every engine.

`config` validates ``--engine`` and the engine flags through it, the CLI
builds the flags' help from it, and the app builds the engine and its pool
from it (docs/architecture.md#adding-an-engine).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from .sglang_chat.spec import SPEC as SGLANG_CHAT
from .sglang_generate.spec import SPEC as SGLANG_GENERATE
from .spec import EngineFlag, EngineSettings, EngineSpec
from .vllm.spec import SPEC as VLLM

__all__ = [
    "AUTO",
    "DEFAULT_ENGINE",
    "ENGINES",
    "engine_flags",
    "engine_names",
    "engine_spec",
    "refuse_unserved",
]

# One line per engine.
ENGINES: Mapping[str, EngineSpec] = MappingProxyType(
    {spec.name: spec for spec in (SGLANG_CHAT, SGLANG_GENERATE, VLLM)}
)
# --engine's value that serves each worker by the token route of its family,
# chosen at start-up from what the workers say (`engines.resolve`).
AUTO = "auto"
# What --engine is when not given (docs/engines.md#engine-auto says why).
DEFAULT_ENGINE = AUTO


def engine_names() -> tuple[str, ...]:
    """Every value --engine takes."""
    return (AUTO, *ENGINES)


def engine_spec(name: str) -> EngineSpec:
    """The engine called `name` (ValueError naming the engines there are)."""
    spec = ENGINES.get(name)
    if spec is None:
        raise ValueError(f"engine must be one of {', '.join(engine_names())}")
    return spec


def engine_flags() -> dict[str, tuple[EngineFlag, str]]:
    """Every engine flag, by `Settings` field: the flag, and its help (each
    engine that takes it, and what it means for that engine)."""
    taken: dict[str, list[tuple[str, EngineFlag]]] = {}
    for spec in ENGINES.values():
        for flag in spec.flags:
            taken.setdefault(flag.field, []).append((spec.name, flag))
    return {
        field: (takers[0][1], "; ".join(f"{name}: {flag.help}" for name, flag in takers))
        for field, takers in taken.items()
    }


def refuse_unserved(settings: EngineSettings, default: Callable[[str], object]) -> None:
    """The engine's own check of `settings`, then: an engine flag it does not
    take must keep its default (`default(field)`), or ValueError naming the
    engines that take it. Under `AUTO` nothing yet: the engine is chosen at
    start-up (`engines.resolve`), and checked then."""
    if settings.engine == AUTO:
        return
    spec = engine_spec(settings.engine)
    spec.check(settings)
    for field, (flag, _) in engine_flags().items():
        if not spec.takes(field) and getattr(settings, field) != default(field):
            takers = ", ".join(s.name for s in ENGINES.values() if s.takes(field))
            raise ValueError(f"{flag.flag} is for --engine {takers}, not {spec.name}")
