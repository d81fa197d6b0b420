"""verl's rollout servers, as its server manager knows them.

verl 0.9.1 launches its SGLang or vLLM servers itself
(``verl/workers/rollout/llm_server.py`` ``LLMServerManager``) and hands each
agent loop an ``LLMServerClient`` whose load balancer (a Ray actor:
``verl/workers/rollout/router.py`` ``GlobalRequestLoadBalancer``) holds the
servers by address (``host:port``, ``RolloutReplica._server_address``);
``get_all_servers`` lists them, replicas the separate-async trainer added
or removed included.
"""

from __future__ import annotations

from typing import Any

__all__ = ["verl_server_addresses"]


async def verl_server_addresses(server_manager: Any) -> list[str]:
    """The addresses of the rollout servers `server_manager` (verl's
    ``LLMServerClient``) balances over."""
    balancer = getattr(server_manager, "_load_balancer", None)
    if balancer is None:
        raise ValueError(
            "workers: verl needs verl's LLMServerClient (its load balancer lists the "
            f"rollout servers); got {type(server_manager).__name__}: list the workers' URLs "
            "under `workers`, or null when the session servers have them"
        )
    addresses: list[str] = list(await balancer.get_all_servers.remote())
    return addresses
