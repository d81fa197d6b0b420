"""Health from probes: admission, ``/health`` rounds, and the served model
(docs/reliability.md#workers).

A worker joins as ``JOINING`` and is admitted once it passes an admission
check: ``GET /health`` answers 200 and what it serves reads as its engine's
worker (the dialect's ``read_model``: SGLang's ``/get_model_info`` +
``/v1/models``, vLLM's ``/v1/models`` and its token route) for a generation
model that lists the served model — the one learned from the first worker,
in pool order, that passed. A healthy worker is probed with ``GET /health``
every ``health_interval_s``: ``unhealthy_after`` failures in a row make it
unhealthy; ``healthy_after`` admission checks in a row bring it back (a
worker restarted with another model never comes back).

Probes use the pool's own small client (never a worker's traffic
connections: a saturated worker must not look dead), and reach a worker the
way its traffic does (no proxy from the environment).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import httpx
import trio

from ...errors import NoHealthyWorker, UpstreamError
from .client import transport_detail
from .dialect import ModelInfo
from .membership import Membership
from .options import PoolOptions
from .worker import Health, Worker

__all__ = ["HealthChecks", "differences", "flag_text", "settings_problem"]

logger = logging.getLogger("rollout_session")

# An admission check's outcome: the worker's model card, or why it failed.
Found = dict[Worker, ModelInfo | str]


def differences(
    settings: Mapping[str, Any],
    wanted: Mapping[str, Any],
    supplied: frozenset[str] = frozenset(),
) -> list[tuple[str, Any, Any]]:
    """(name, the worker's value, the wanted one) for each setting both name
    and they disagree on. Not compared: a setting a worker does not publish,
    and one of `supplied` it runs without (None: the server supplies it)."""
    return [
        (name, settings[name], value)
        for name, value in wanted.items()
        if name in settings
        and settings[name] != value
        and not (settings[name] is None and name in supplied)
    ]


def flag_text(
    name: str, value: Any, described: Mapping[str, Callable[[Any], str]] = MappingProxyType({})
) -> str:
    """A launch setting as its flag on a command line, or as `described`
    (the dialect's `settings_text`) says it where it is no flag."""
    if name in described:
        return described[name](value)
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value}" if value is not None else f"no {flag}"


def settings_problem(
    settings: Mapping[str, Any],
    expected: Mapping[str, Any],
    served: Mapping[str, Any],
    supplied: frozenset[str] = frozenset(),
    described: Mapping[str, Callable[[Any], str]] = MappingProxyType({}),
) -> str | None:
    """Why a worker with these launch `settings` cannot join: one that
    contradicts what the server expects, or (for a setting the server
    expects nothing of) what the pool's first worker runs, naming both
    values; None when none does."""
    for name, got, want in differences(settings, expected, supplied):
        return (
            f"runs {flag_text(name, got, described)}, where this server expects "
            f"{flag_text(name, want, described)}"
        )
    unexpected = {k: v for k, v in served.items() if k not in expected}
    for name, got, want in differences(settings, unexpected):
        return (
            f"runs {flag_text(name, got, described)}, where the pool's workers run "
            f"{flag_text(name, want, described)}"
        )
    return None


class HealthChecks:
    def __init__(
        self,
        members: Membership,
        options: PoolOptions,
        probe_client: httpx.AsyncClient,
        clock: Callable[[], float],
    ) -> None:
        self._members = members
        self._options = options
        self._dialect = options.dialect
        self._client = probe_client
        self._clock = clock
        # The served model: learned from the first worker that passed an
        # admission check; every worker must list it.
        self.served: ModelInfo | None = None
        self.first_round = trio.Event()
        # Workers whose /server_info was read for --kv-sessions hint (once each).
        self._hints_asked: set[str] = set()

    async def model_info(self) -> ModelInfo:
        """The served model's card, once a worker passed an admission check
        (after the first round of checks when the pool runs)."""
        if self.served is None and self._members.nursery is not None:
            await self.first_round.wait()
        if self.served is None:
            reasons = "; ".join(
                f"{w.url}: {w.last_error}" for w in self._members.workers.values() if w.last_error
            )
            raise NoHealthyWorker(
                f"no {self._dialect.name} worker has been admitted yet"
                + (f" ({reasons})" if reasons else ""),
                retry_after_s=self._options.retry_after_s,
            )
        return self.served

    # -- a round ------------------------------------------------------------------

    async def round(self) -> None:
        """Probe every healthy worker, check every other for admission."""
        found: Found = {}
        async with trio.open_nursery() as probes:
            for worker in list(self._members.workers.values()):
                if worker.health is Health.HEALTHY:
                    probes.start_soon(self._probe, worker)
                else:
                    probes.start_soon(self._check, worker, found)
        self._admit(found)
        self.first_round.set()

    def admit_soon(self, worker: Worker) -> None:
        """Check a worker that joined a running pool now, not at the next round.
        Before start-up learned the model, the first round admits it."""
        if self.served is not None:
            self._members.start_soon(self._admit_one, worker)

    async def _admit_one(self, worker: Worker) -> None:
        found: Found = {}
        await self._check(worker, found)
        self._admit(found)

    async def admit_now(self, worker: Worker) -> str | None:
        """One admission check of a worker joining at run time, now: why it
        cannot join when it answers ``/health`` but is not a worker this pool
        takes (another engine's, another model, other launch settings); None
        when it was admitted, or did not answer (it stays joining: it may be
        starting)."""
        found: Found = {}
        answered = await self._check(worker, found)
        self._admit(found)
        if answered and worker.health is not Health.HEALTHY:
            return worker.last_error
        return None

    async def failure(self, worker: Worker) -> str | None:
        """Why `GET /health` failed, None when it answered 200."""
        timeout = self._options.health_timeout_s
        try:
            with trio.fail_after(timeout):
                # The status is the answer; a body is never read.
                async with self._client.stream("GET", f"{worker.url}/health") as response:
                    status = response.status_code
        except trio.TooSlowError:
            return f"GET /health: no answer within {timeout:g} s"
        except httpx.HTTPError as exc:
            return f"GET /health: {transport_detail(exc)}"
        return None if status == 200 else f"GET /health answered {status}"

    async def _probe(self, worker: Worker) -> None:
        reason = await self.failure(worker)
        worker.last_checked_at = self._clock()
        if self._members.member(worker):
            self._record(worker, ok=reason is None, reason=reason)

    async def _check(self, worker: Worker, found: Found) -> bool:
        """An admission check: /health, then what the worker serves (into
        `found`: its model card, or why it is not its engine's worker).
        Returns whether it answered /health."""
        failure = await self.failure(worker)
        if failure is not None:
            found[worker] = failure
        else:
            try:
                found[worker] = await self._dialect.read_model(
                    worker.client, self._options.read_model_s
                )
            except UpstreamError as exc:
                found[worker] = str(exc)
        worker.last_checked_at = self._clock()
        return failure is None

    def _admit(self, found: Found) -> None:
        """Record admission checks: a worker passes if it lists the served
        model and runs with the expected launch settings and those of the
        pool's first worker (the served model and its settings are learned
        here, in pool order, when not yet known)."""
        expected = self._options.expected_settings
        supplied = self._options.supplied_settings
        if self.served is None:
            for worker in self._members.workers.values():
                card = found.get(worker)
                if (
                    isinstance(card, ModelInfo)
                    and not differences(card.settings, expected, supplied)
                    and self._inadmissible(card) is None
                ):
                    self.served = card
                    logger.info(
                        "%sserving model %s (as %s reports it)",
                        self._options.label,
                        card.model,
                        worker.url,
                    )
                    break
        for worker, card in found.items():
            if not self._members.member(worker):
                continue
            if not isinstance(card, ModelInfo):
                self._record(worker, ok=False, reason=card)
            elif self.served is None:
                # No worker ran as expected yet: this one does not either.
                problem = settings_problem(
                    card.settings, expected, {}, supplied, self._dialect.settings_text
                ) or self._inadmissible(card)
                self._record(worker, ok=False, reason=problem or "not admitted yet")
            elif self.served.model not in card.models:
                listed = ", ".join(card.models)
                self._record(worker, ok=False, reason=f"serves {listed}, not {self.served.model}")
            elif problem := (
                settings_problem(
                    card.settings,
                    expected,
                    self.served.settings,
                    supplied,
                    self._dialect.settings_text,
                )
                or self._inadmissible(card)
            ):
                self._record(worker, ok=False, reason=problem)
            else:
                worker.model = self.served.model
                self._record(worker, ok=True)
                self._check_hint_support(worker)

    def _inadmissible(self, card: ModelInfo) -> str | None:
        """Why the engine cannot serve a worker with this card's launch
        settings (`PoolOptions.admissible`), None when it can."""
        admissible = self._options.admissible
        return admissible(card.settings) if admissible is not None else None

    def _record(self, worker: Worker, *, ok: bool, reason: str | None = None) -> None:
        """One probe's outcome: a /health probe of a healthy worker, or an
        admission check of any other."""
        options = self._options
        if ok:
            worker.consecutive_successes += 1
            worker.consecutive_failures = 0
            if worker.health is Health.JOINING or (
                worker.health is Health.UNHEALTHY
                and worker.consecutive_successes >= options.healthy_after
            ):
                joined = worker.health is Health.JOINING
                worker.health = Health.HEALTHY
                logger.info(
                    "worker %s %s (serves %s)",
                    worker.url,
                    "admitted" if joined else "is healthy again",
                    worker.model,
                )
        else:
            worker.consecutive_failures += 1
            worker.consecutive_successes = 0
            if reason != worker.last_error:
                logger.warning("worker %s: %s", worker.url, reason)
            worker.last_error = reason
            if (
                worker.health is Health.HEALTHY
                and worker.consecutive_failures >= options.unhealthy_after
            ):
                worker.health = Health.UNHEALTHY
                logger.warning("worker %s marked unhealthy", worker.url)
        self._members.notify()

    # -- what a worker says about itself ------------------------------------------

    async def server_info(self, url: str) -> dict[str, Any]:
        """The worker's ``/server_info`` (SGLang's server args), or {} when it
        cannot be read (a gateway in front, an older worker)."""
        try:
            response = await self._client.get(f"{url}/server_info")
            data = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        return data if isinstance(data, dict) else {}

    def _check_hint_support(self, worker: Worker) -> None:
        """With --kv-sessions hint, warn (once per worker) when the worker
        does not say it runs --enable-session-radix-cache: without it SGLang
        ignores the hints, and nothing else would tell the operator."""
        if not self._options.sends_session_hints or worker.url in self._hints_asked:
            return
        self._hints_asked.add(worker.url)
        self._members.start_soon(self._read_hint_support, worker)

    async def _read_hint_support(self, worker: Worker) -> None:
        info = await self.server_info(worker.url)
        enabled = info.get("enable_session_radix_cache") is True
        worker.session_hints = enabled
        self._members.notify()
        if not enabled:
            logger.warning(
                "--kv-sessions hint: worker %s does not report enable_session_radix_cache "
                "in /server_info; SGLang ignores session ids unless it runs with "
                "--enable-session-radix-cache (docs/kv-sessions.md)",
                worker.url,
            )
