"""What `SessionGenerator` is told: its options from SkyRL's config
(``generator.rollout_session``, `config`) with keyword arguments over them,
and SkyRL's sampling parameters as the session's pinned sampling.

Nothing here imports SkyRL: the config is read by attribute, so a test
may pass any object of its shape, or None and every option as a keyword.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from ..agent import Agent, load_agent
from ..segments import experts_top_k as model_experts_top_k

__all__ = ["UNSET", "Options", "pinned_sampling", "resolve_options", "wants_logprobs"]

logger = logging.getLogger("rollout_session.trainers")

OnError = Literal["mask", "raise"]
SyncMode = Literal["abort", "drain"]


class _Unset:
    """A keyword argument not given (None is a value: ``workers=None``)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()

# The session's pinnable sampling keys (docs/api.md#pinned-sampling), as
# SkyRL's vLLM sampling dict names them
# (``inference_servers/engine_utils.py`` ``get_vllm_sampling_params``;
# ``repetition_penalty``, the penalties and ``seed`` come through its
# ``additional_kwargs``).
PINNED: Final = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
)
# Keys that change what is returned, not what is sampled: the session
# records every token's logprob and the exact ids whatever they say.
_NO_EFFECT: Final = frozenset({"skip_special_tokens", "include_stop_str_in_output", "logprobs"})


@dataclass(frozen=True, slots=True)
class Options:
    # The session servers' URLs.
    servers: tuple[str, ...]
    agent: Agent
    # "skyrl": the inference client's ``server_urls``; URLs; None: the
    # session servers already have their workers.
    workers: Literal["skyrl"] | tuple[str, ...] | None
    # The session servers' trainer and operator keys.
    api_key: str | None
    admin_api_key: str | None
    # Episodes at once, per generate() call.
    max_concurrency: int
    # How SkyRL's weight sync pauses the session servers; None: not at all.
    weight_sync: SyncMode | None
    # An episode that cannot be trained on exactly: a row that trains
    # nothing ("mask"), or the batch fails ("raise").
    on_error: OnError
    # SkyRL's ``generator.step_wise_trajectories``.
    step_wise: bool
    # Routed experts per layer when SkyRL replays them (R3:
    # ``generator.inference_engine.enable_return_routed_experts``); None: off.
    experts_top_k: int | None


def resolve_options(cfg: Any, overrides: Mapping[str, Any]) -> Options:
    """The options under ``cfg.generator.rollout_session`` (`config`), each
    replaced by the keyword of its name in `overrides` unless that is
    `UNSET`; ``step_wise`` and ``routed_experts`` override SkyRL's own
    settings (``generator.step_wise_trajectories``,
    ``generator.inference_engine.enable_return_routed_experts``)."""
    generator = getattr(cfg, "generator", None)
    section = getattr(generator, "rollout_session", None)

    def pick(name: str, default: Any) -> Any:
        value = overrides.get(name, UNSET)
        if value is not UNSET:
            return value
        return getattr(section, name, default) if section is not None else default

    servers = pick("servers", ())
    if isinstance(servers, str) or not servers:
        raise ValueError(
            "rollout_session.servers: the session servers' URLs, a list "
            f"(generator.rollout_session.servers='[\"http://host:8000\"]'), not {servers!r}"
        )
    agent = pick("agent", None)
    if not agent:
        raise ValueError(
            "rollout_session.agent: the agent, 'package.module:function' "
            "(async def solve(session, row) -> float | None)"
        )
    step_wise = pick("step_wise", UNSET)
    if step_wise is UNSET:
        step_wise = bool(getattr(generator, "step_wise_trajectories", False))
    routes = pick("routed_experts", UNSET)
    if routes is UNSET:
        engine = getattr(generator, "inference_engine", None)
        routes = bool(getattr(engine, "enable_return_routed_experts", False))
    top_k = pick("experts_top_k", None)
    if routes and top_k is None:
        top_k = model_experts_top_k(str(cfg.trainer.policy.model.path))
    max_concurrency = int(pick("max_concurrency", 256))
    if max_concurrency < 1:
        raise ValueError(f"rollout_session.max_concurrency must be ≥ 1, not {max_concurrency}")
    return Options(
        servers=tuple(str(s).rstrip("/") for s in servers),
        agent=load_agent(agent),
        workers=_workers(pick("workers", "skyrl")),
        api_key=pick("api_key", None),
        admin_api_key=pick("admin_api_key", None),
        max_concurrency=max_concurrency,
        weight_sync=_choice("weight_sync", pick("weight_sync", "abort"), ("abort", "drain", None)),
        on_error=_choice("on_error", pick("on_error", "mask"), ("mask", "raise")),
        step_wise=bool(step_wise),
        experts_top_k=int(top_k) if routes else None,
    )


def _workers(value: Any) -> Literal["skyrl"] | tuple[str, ...] | None:
    if value is None or value == "skyrl":
        return value  # type: ignore[no-any-return]
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"rollout_session.workers: 'skyrl', a list of URLs, or null; not {value!r}")
    return tuple(str(w) for w in value)


def _choice(name: str, value: Any, allowed: Sequence[Any]) -> Any:
    if value not in allowed:
        listed = ", ".join("null" if a is None else repr(a) for a in allowed)
        raise ValueError(f"rollout_session.{name}: one of {listed}; not {value!r}")
    return value


def pinned_sampling(params: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """SkyRL's sampling parameters of a batch (``GeneratorInput.sampling_params``)
    as the session's pinned sampling, and those a session cannot pin that
    could change what is sampled (``stop``, ``min_tokens``, an
    ``additional_kwargs`` key it does not know): the caller says so."""
    pinned: dict[str, Any] = {}
    unpinned: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if value is None or key in _NO_EFFECT:
            continue
        if key in PINNED:
            pinned[key] = value
        elif (key == "stop" and not value) or (key == "min_tokens" and value == 0):
            continue
        else:
            unpinned[key] = value
    return pinned, unpinned


def wants_logprobs(params: Mapping[str, Any] | None, cfg: Any) -> bool:
    """Whether the batch asks for rollout logprobs, by SkyRL's own rule
    (``generators/skyrl_gym_generator.py`` ``generate``: the batch's
    ``logprobs`` when it has sampling parameters, else the config's)."""
    if params is not None:
        return params.get("logprobs") is not None
    sampling = getattr(getattr(cfg, "generator", None), "sampling_params", None)
    return sampling is None or getattr(sampling, "logprobs", 1) is not None
