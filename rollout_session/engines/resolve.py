"""How ``--engine`` becomes one engine with its settings, at start-up, from
what the workers say about themselves (docs/engines.md#engine-auto).

Every configured worker is read once, the way its pool will admit it (the
candidate engine's dialect: SGLang's ``/get_model_info``, ``/v1/models``
and ``/server_info``; vLLM's ``/v1/models`` and its token route):

- ``--engine auto`` tries each engine the registry marks `auto` (the token
  route of each family, `sglang-generate` and `vllm`): a worker is of the
  family whose dialect admits it. Workers of two families, or serving two
  models, are refused, naming them.
- The launch settings the engine reads from its workers
  (`EngineSpec.worker_settings`: the parsers, ``skip_tokenizer_init``)
  must agree across the workers that publish them, and a flag given here
  must agree with them: a disagreement is refused, naming both values. An
  unset flag takes the workers' value. A worker that runs without one the
  engine can supply (`EngineSpec.supplied`: `sglang-generate`'s parsers,
  whose parse routes take the name per request) disagrees with nothing.
- The engine then checks the result (`EngineSpec.check`, `EngineSpec.needs`);
  under ``auto`` an engine that refuses its workers' settings hands them to
  its `fallback` (`sglang-generate`: a reasoning parser it does not
  reproduce is served by `sglang-chat`), and the choice is logged.

A worker that does not answer is left to its pool (it is admitted later if
it matches). With a named engine and no worker answering (or none
configured: a trainer's servers join by ``POST /workers``), the flags are
taken as given, and the launch settings no flag gives are *unread* (but
those the engine needs or supplies itself): the pool learns them from the
first worker it admits (`Resolved.unread`), which
must pass the checks a read worker passes at start-up
(`Resolved.admissible`); every later worker must run the same. ``auto``
needs at least one worker that answers.
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import trio

from ..errors import UpstreamError, WorkerUnfit
from .pool.client import WorkerClient
from .pool.dialect import ModelInfo
from .pool.health import flag_text
from .registry import AUTO, ENGINES, engine_spec
from .spec import EngineSettings, EngineSpec

__all__ = ["Resolved", "resolve_engine"]

logger = logging.getLogger("rollout_session")


@dataclass(frozen=True, slots=True)
class Resolved:
    spec: EngineSpec
    # The engine flags, filled in from the workers (`dataclasses.replace`d
    # settings: `engine` is the spec's name).
    settings: EngineSettings
    # The launch settings its workers run with (`spec.worker_settings` names):
    # what the pool requires of every worker, and what the engine is built for.
    launch: Mapping[str, Any]
    # Those no worker said at start-up and no flag gave (`launch` holds the
    # engine's default for them): learned from the first worker admitted.
    unread: frozenset[str] = frozenset()

    @property
    def expected(self) -> Mapping[str, Any]:
        """What the pool requires of every worker: `launch` but the unread."""
        return {k: v for k, v in self.launch.items() if k not in self.unread}

    def admissible(self, settings: Mapping[str, Any]) -> str | None:
        """Why a worker publishing these launch settings cannot be served by
        the engine (its `EngineSpec.agrees` and `EngineSpec.needs`, as at
        start-up), None when it can: for a pool that learns the unread."""
        spec = self.spec
        launch = {**self.launch, **{k: v for k, v in settings.items() if k in self.unread}}
        try:
            spec.agrees(self.settings, launch)
        except ValueError as contradicted:
            return str(contradicted)
        return _unmet(spec, settings)


class _Contradicted(ValueError):
    """A flag that contradicts the workers: no other engine is tried."""


@dataclass(frozen=True, slots=True)
class _Answer:
    url: str
    spec: EngineSpec
    info: ModelInfo


async def resolve_engine(
    settings: EngineSettings,
    workers: Sequence[str],
    *,
    tls: ssl.SSLContext,
    deadline_s: float,
    connect_timeout_s: float,
) -> Resolved:
    """The engine `settings` ask for (see the module), or ValueError with
    the reason and the fix."""
    auto = settings.engine == AUTO
    candidates = [s for s in ENGINES.values() if s.auto] if auto else [engine_spec(settings.engine)]
    answers, silent = await _read_workers(
        workers, candidates, tls=tls, deadline_s=deadline_s, connect_timeout_s=connect_timeout_s
    )
    if not answers:
        if auto:
            reasons = "; ".join(f"{url}: {why}" for url, why in silent) or "no worker is configured"
            raise ValueError(
                f"--engine auto: no worker can serve ({reasons}); start the workers "
                "(with the flags named), or name the engine with --engine"
            )
        spec = candidates[0]
        # Not those the engine needs, nor those it supplies (its flags are
        # what it serves with: sglang-generate's parsers).
        unread = frozenset(
            name
            for name in spec.worker_settings
            if name not in spec.needs
            and name not in spec.supplied
            and getattr(settings, name, None) is None
        )
        return _resolved(settings, spec, _launch(settings, spec, {}), unread=unread)
    spec = _one_family(answers)
    _one_model(answers)
    published = _agreed(answers, spec)
    try:
        resolved = _checked(settings, spec, published)
    except _Contradicted:
        raise
    except ValueError as refused:
        if not (auto and spec.fallback):
            raise
        fallback = engine_spec(spec.fallback)
        try:
            resolved = _checked(settings, fallback, published)
        except ValueError as also:
            raise ValueError(f"{refused}; and {fallback.name} cannot serve them: {also}") from None
        logger.info(
            "--engine auto: serving the workers with %s: %s does not (%s)",
            fallback.name,
            spec.name,
            refused,
        )
    _warn_unparsed(resolved)
    return resolved


def _warn_unparsed(resolved: Resolved) -> None:
    """A tool call is text in the agent's answer without a tool-call parser:
    said once at start-up, with the fix."""
    spec = resolved.spec
    if "tool_call_parser" not in spec.worker_settings or resolved.launch["tool_call_parser"]:
        return
    here = " (or start this server with it)" if "tool_call_parser" in spec.supplied else ""
    logger.warning(
        "%s: no tool-call parser, so tool calls reach agents as text in the answer's "
        "content: launch the workers with --tool-call-parser NAME%s",
        spec.name,
        here,
    )


async def _read_workers(
    workers: Sequence[str],
    candidates: Sequence[EngineSpec],
    *,
    tls: ssl.SSLContext,
    deadline_s: float,
    connect_timeout_s: float,
) -> tuple[list[_Answer], list[tuple[str, str]]]:
    """Each worker's answer to the first candidate whose dialect admits it
    (in `workers`' order), and why each other one answered none."""
    found: dict[str, _Answer | str] = {}

    async def read(url: str) -> None:
        client = WorkerClient(
            url,
            max_connections=1,
            timeout_s=deadline_s,
            connect_timeout_s=connect_timeout_s,
            tls=tls,
        )
        reasons = []
        try:
            for spec in candidates:
                try:
                    info = await spec.dialect.read_model(client, deadline_s)
                except WorkerUnfit as exc:
                    # Of this kind: the other kinds' reasons would only mislead.
                    found[url] = f"a {spec.dialect.name} worker, but {exc}"
                    return
                except UpstreamError as exc:
                    reasons.append(
                        f"not {spec.dialect.name}: {exc}" if len(candidates) > 1 else str(exc)
                    )
                    continue
                found[url] = _Answer(url, spec, info)
                return
            found[url] = "; ".join(reasons)
        finally:
            await client.aclose()

    async with trio.open_nursery() as nursery:
        for url in workers:
            nursery.start_soon(read, url)
    answers = [a for url in workers if isinstance(a := found[url], _Answer)]
    silent = [(url, a) for url in workers if isinstance(a := found[url], str)]
    return answers, silent


def _one_family(answers: list[_Answer]) -> EngineSpec:
    first = answers[0]
    for other in answers[1:]:
        if other.spec is not first.spec:
            raise ValueError(
                f"the workers are of two kinds: {first.url} answers as a "
                f"{first.spec.dialect.name} worker, {other.url} as a {other.spec.dialect.name} "
                "worker; one server serves one kind (run a server per kind)"
            )
    return first.spec


def _one_model(answers: list[_Answer]) -> None:
    model = answers[0].info.model
    for other in answers[1:]:
        if model not in other.info.models:
            raise ValueError(
                f"the workers serve different models: {answers[0].url} serves {model}, "
                f"{other.url} serves {', '.join(other.info.models)}"
            )


def _agreed(answers: list[_Answer], spec: EngineSpec) -> dict[str, Any]:
    """The launch settings `spec` reads, as the workers that publish them
    agree on them (ValueError naming two that do not)."""
    text = spec.dialect.settings_text
    published: dict[str, Any] = {}
    first: dict[str, str] = {}
    for answer in answers:
        for name, value in answer.info.settings.items():
            if name not in spec.worker_settings or (value is None and name in spec.supplied):
                continue
            if name in published and published[name] != value:
                raise ValueError(
                    f"the workers disagree: {first[name]} runs "
                    f"{flag_text(name, published[name], text)}, {answer.url} runs "
                    f"{flag_text(name, value, text)}; every worker of a server runs the same"
                )
            published.setdefault(name, value)
            first.setdefault(name, answer.url)
    return published


def _launch(
    settings: EngineSettings, spec: EngineSpec, published: Mapping[str, Any]
) -> dict[str, Any]:
    """Each launch setting `spec` reads: the flag of its name where one was
    given (it must agree with the workers), else the workers', else the
    engine's default."""
    text = spec.dialect.settings_text
    launch: dict[str, Any] = {}
    for name, default in spec.worker_settings.items():
        given = spec.canonical(name, getattr(settings, name, None))
        if given is not None and name in spec.supplied and name not in published:
            logger.info(
                "%s: the workers publish no %s; %s is this server's",
                spec.name,
                name,
                flag_text(name, given, text),
            )
        elif given is not None and name in published and published[name] != given:
            raise _Contradicted(
                f"the workers run {flag_text(name, published[name], text)}, but "
                f"{flag_text(name, given, text)} was given here: start the server without "
                "it (the workers' own is taken), or the workers with it"
            )
        launch[name] = given if given is not None else published.get(name, default)
    return launch


def _checked(settings: EngineSettings, spec: EngineSpec, published: Mapping[str, Any]) -> Resolved:
    """`spec` over workers that publish these settings, checked (ValueError)."""
    launch = _launch(settings, spec, published)
    try:
        spec.agrees(settings, launch)
    except ValueError as contradicted:
        raise _Contradicted(str(contradicted)) from None
    if (unmet := _unmet(spec, launch)) is not None:
        raise ValueError(unmet)
    # Building the settings checks them (the engine's `check`, its flags).
    return _resolved(settings, spec, launch, published)


def _unmet(spec: EngineSpec, launch: Mapping[str, Any]) -> str | None:
    """The engine's `EngineSpec.needs` these launch settings miss, said."""
    text = spec.dialect.settings_text
    for name, value in spec.needs.items():
        if name in launch and launch[name] != value:
            return (
                f"--engine {spec.name} needs workers with {flag_text(name, value, text)}; "
                f"they run with {flag_text(name, launch[name], text)}"
            )
    return None


def _resolved(
    settings: EngineSettings,
    spec: EngineSpec,
    launch: Mapping[str, Any],
    published: Mapping[str, Any] = MappingProxyType({}),
    *,
    unread: frozenset[str] = frozenset(),
) -> Resolved:
    """`spec` with its flags set to `launch`'s values; a flag it does not
    take that only repeats the workers' value (`sglang-chat` after ``auto``
    fell back to it) is cleared rather than refused."""
    flags: dict[str, Any] = {}
    for name, value in launch.items():
        if spec.takes(name) and name not in unread:
            flags[name] = value
        elif name in published and getattr(settings, name, None) is not None:
            flags[name] = None
    chosen: Any = dataclasses.replace(settings, engine=spec.name, **flags)  # type: ignore[type-var]
    return Resolved(spec, chosen, launch, unread)
