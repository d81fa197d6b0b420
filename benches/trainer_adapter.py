"""The trainer adapter's cost per episode: what verl's `SessionAgentLoop`
adds to an episode beyond the agent's own turns, against the export alone.

An emulator worker and a session server run as processes; this process is
the trainer side. Each episode is 16 turns of ~2k tokens (a ~1.5k-token
user message, a ~500-token answer: ~32k tokens), driven by a scripted agent
over raw HTTP. Per repeat, paired and in alternating order:

- ``export``: the trainer's work as a plain client: ``create`` the session,
  the agent's turns (not counted), ``close`` (the schema-3 export);
- ``adapter``: the adapter's: `run_episode` (``create`` with the trainer's
  sampling pinned, the agent's turns (not counted), ``close``), then
  `verl_outputs` into verl's ``AgentLoopOutput`` (when verl is installed:
  run it with ``.venv-verl/bin/python``; else a dict stands in, said in the
  output).

Both report the trainer process's wall ms per episode outside the agent's
turns (the agent runs in this process too, so its CPU is not separable).
verl's own ``as_dict()`` (the output into tensors), which verl runs on any
agent loop's output, is timed apart. Target: adapter ≤ 1.2× export.

    .venv-verl/bin/python benches/trainer_adapter.py
    .venv-verl/bin/python benches/trainer_adapter.py --repeats 10
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import trio
from _common import bench_parser, children, emulator_command, load_average, server_command, table

from rollout_session.client import SessionClient
from rollout_session.trainers import AgentSession, Episode, run_episode
from rollout_session.trainers.verl.outputs import Limits, verl_outputs

TURNS = 16
USER_WORDS = 650  # ~1.4k tokens of the bundled vocabulary
ANSWER_TOKENS = 500
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": ANSWER_TOKENS}


def _verl() -> tuple[Callable[..., Any], Callable[..., Any], bool]:
    try:
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    except ImportError:
        return dict, dict, False
    return AgentLoopOutput, AgentLoopMetrics, True


class Agent:
    """16 scripted turns over raw HTTP; it times itself, so its turns are
    taken out of the trainer's cost."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.spent_s = 0.0

    async def __call__(self, session: AgentSession, row: Mapping[str, Any]) -> float | None:
        started = time.perf_counter()
        messages: list[dict[str, Any]] = []
        for turn in range(TURNS):
            words = " ".join(f"word{(turn * 7 + i) % 500}" for i in range(USER_WORDS))
            messages.append({"role": "user", "content": words})
            answer = await self.http.post(
                f"{session.base_url}/chat/completions",
                json={"model": "m", "messages": messages, "max_tokens": ANSWER_TOKENS},
            )
            if answer.status_code != 200:
                raise RuntimeError(f"turn {turn}: {answer.status_code} {answer.text[:300]}")
            messages.append(answer.json()["choices"][0]["message"])
        self.spent_s += time.perf_counter() - started
        return 1.0


async def export_alone(client: SessionClient, agent: Agent) -> tuple[float, float, int]:
    wall = time.perf_counter()
    agent.spent_s = 0.0
    handle = await client.create()
    session = AgentSession(handle.session_id, handle.base_url, "unused")
    await agent(session, {})
    document = await client.close(handle)
    tokens = sum(len(s["token_ids"]) for s in document["segments"])
    return (time.perf_counter() - wall - agent.spent_s), 0.0, tokens


async def adapter(
    client: SessionClient, agent: Agent, make: Callable[..., Any], metrics: Callable[..., Any]
) -> tuple[float, float, int]:
    wall = time.perf_counter()
    agent.spent_s = 0.0
    episode: Episode = await run_episode(client, agent, {}, sampling=SAMPLING)
    limits = Limits(prompt_length=40_000, response_length=40_000, every_segment=True)
    outputs = verl_outputs(episode, limits, make, metrics)
    spent = time.perf_counter() - wall - agent.spent_s
    started = time.perf_counter()
    for output in outputs:
        if hasattr(output, "as_dict"):
            output.as_dict()
    tokens = sum(len(s["token_ids"]) for s in episode.document["segments"])
    return spent, time.perf_counter() - started, tokens


async def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    make, metrics, real = _verl()
    emulator = emulator_command("--completion-tokens", str(ANSWER_TOKENS), "--seed", "3")
    async with children([("emulator", emulator)]) as [worker]:  # noqa: SIM117 (the server needs its URL)
        async with (
            children([("server", server_command([worker.url]))]) as [server],
            SessionClient([server.url]) as client,
            httpx.AsyncClient(timeout=120) as http,
        ):
            agent = Agent(http)
            await export_alone(client, agent)  # warm both paths
            await adapter(client, agent, make, metrics)
            runs: dict[str, list[tuple[float, float, int]]] = {"export": [], "adapter": []}
            for repeat in range(args.repeats):
                order = ["export", "adapter"] if repeat % 2 == 0 else ["adapter", "export"]
                for name in order:
                    if name == "export":
                        runs[name].append(await export_alone(client, agent))
                    else:
                        runs[name].append(await adapter(client, agent, make, metrics))
    ratios_wall = [a[0] / e[0] for a, e in zip(runs["adapter"], runs["export"], strict=True)]
    rows = [
        {
            "path": name,
            "tokens/episode": runs[name][0][2],
            "wall ms (median)": f"{statistics.median(r[0] for r in runs[name]) * 1e3:.1f}",
        }
        for name in ("export", "adapter")
    ]
    print(
        f"verl's AgentLoopOutput: {'yes' if real else 'no (dict stands in)'}; "
        f"{args.repeats} paired repeats; load {load_average()}"
    )
    print(table(rows))
    print(
        f"adapter / export, paired: {statistics.median(ratios_wall):.2f}× "
        f"({min(ratios_wall):.2f}–{max(ratios_wall):.2f}); verl's own as_dict(): "
        f"{statistics.median(r[1] for r in runs['adapter']) * 1e3:.1f} ms per episode"
    )


if __name__ == "__main__":
    trio.run(main)
