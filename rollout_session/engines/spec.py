"""What an engine package declares (`EngineSpec`), and what it is built from.

An engine package has one ``spec`` module with one `EngineSpec`: its name,
its line in ``--engine``'s help, how the pool speaks to its workers, the
engine flags it takes, the check of their values, and how it is built. The
registry (`registry`) lists the specs; `config`, the CLI and the app read
engines only through it, so adding an engine is one package and one
registry line (docs/architecture.md#adding-an-engine).

Start-up work an engine needs (reading the model's files) is its own
`Engine.prepare`, called once the tokenizer is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from .base import Engine
from .pool import WorkerDialect, WorkerPool
from .served_model import ServedModel

__all__ = ["EngineFlag", "EngineParts", "EngineSettings", "EngineSpec", "Launch", "boolean"]


class EngineSettings(Protocol):
    """What an engine reads of the server's settings (`config.Settings`
    has these fields; the engines wing cannot import it)."""

    @property
    def engine(self) -> str: ...

    @property
    def tool_call_parser(self) -> str | None: ...

    @property
    def reasoning_parser(self) -> str | None: ...

    @property
    def kv_sessions(self) -> str: ...

    @property
    def session_ttl_s(self) -> float | None: ...


def boolean(value: str) -> bool:
    """A boolean flag's value: 1/true/yes/on or 0/false/no/off (its name is
    argparse's word for a value it refuses: "invalid boolean value")."""
    if value.lower() in {"1", "true", "yes", "on"}:
        return True
    if value.lower() in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {value!r}")


@dataclass(frozen=True, slots=True)
class EngineFlag:
    """A ``serve`` flag an engine takes; it sets the `Settings` field of the
    same name (``--tool-call-parser`` → ``tool_call_parser``). Several
    engines may take one flag, each saying what it means for it."""

    flag: str
    help: str
    # How its value is read from the command line or the environment.
    kind: Callable[[str], Any] = str

    @property
    def field(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


class Launch(Mapping[str, Any]):
    """The launch settings an engine is built for (`EngineParts.launch`):
    those start-up resolved, and for the `unread` ones (no worker said them
    then, no flag gave them: a server started without workers) the value
    the pool's first admitted worker published, once it admitted one.
    Engines read them per turn."""

    __slots__ = ("_pool", "_resolved", "_unread")

    def __init__(
        self, resolved: Mapping[str, Any], unread: frozenset[str], pool: WorkerPool
    ) -> None:
        self._resolved = resolved
        self._unread = unread
        self._pool = pool

    def __getitem__(self, name: str) -> Any:
        if name in self._unread:
            served = self._pool.served
            if served is not None and name in served.settings:
                return served.settings[name]
        return self._resolved[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolved)

    def __len__(self) -> int:
        return len(self._resolved)


@dataclass(frozen=True, slots=True)
class EngineParts:
    """The services an engine is built on, owned by the app."""

    pool: WorkerPool  # its workers: placement, failover, checks, circuits
    model: ServedModel  # the served model's name and context
    # The launch settings its workers run with (`EngineSpec.worker_settings`
    # names), as the start-up resolution found them (`engines.resolve`).
    launch: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str  # the --engine value
    summary: str  # what it is, for --engine's help
    dialect: WorkerDialect  # how the pool speaks to its workers
    flags: tuple[EngineFlag, ...]  # the engine flags it takes (any other must stay unset)
    # The values of its flags (and of the settings it reads) it cannot serve:
    # ValueError naming the reason and, where there is one, the fix. Runs
    # before the generic refusal of flags it does not take, so an engine can
    # say why it takes none of one.
    check: Callable[[EngineSettings], None]
    build: Callable[[EngineSettings, EngineParts], Engine]
    # The launch settings it reads from its workers (`ModelInfo.settings`
    # names), with the default it assumes where none says: every worker must
    # run with the same values (an engine flag of the same name must agree).
    worker_settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Those of them a worker may run without, this server supplying the
    # value (a flag of the same name, or another worker's): a worker that
    # publishes none for one of these is not refused for it.
    supplied: frozenset[str] = frozenset()
    # Its flags against the launch settings its workers run with, where no
    # flag of the same name compares them (ValueError naming both sides).
    agrees: Callable[[EngineSettings, Mapping[str, Any]], None] = lambda settings, launch: None
    # Values of those its workers must have (a worker without them is refused).
    needs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # A launch setting's value as its workers run it (a flag's value is
    # compared, and the engine built, with this: SGLang's renamed parsers).
    canonical: Callable[[str, Any], Any] = lambda name, value: value
    # `--engine auto` serves the workers its dialect admits with it: the
    # token route of each engine family.
    auto: bool = False
    # What `auto` serves those workers with when this engine refuses their
    # settings (None: the start is refused, with this engine's reason).
    fallback: str | None = None

    def takes(self, field: str) -> bool:
        return any(flag.field == field for flag in self.flags)
