"""Weight updates: the trainer's pause with ``drain`` vs ``abort``, and what
continuing the interrupted turns costs, in the same run.

``--agents`` (64) agents each create a session and send one long reasoning
turn (a ~1k-token prompt, ``--prompt-words``) to a fresh session server
(``--engine sglang-generate --reasoning-parser qwen3 --chat-template qwen3``)
in front of ``--workers`` (2) fresh SGLang emulator processes
(``--reasoning --chat-template qwen3 --gpu-contention``): every answer is a
``<think>`` block and a text of exactly ``--completion-tokens`` (2000)
tokens at ``--decode-s-per-token`` (0.002 s per batched decode step), after
a serialised prefill at ``--prefill-s-per-token`` (2e-5 s per uncached
token, stalling the worker's decodes), so a turn decodes for ~4 s.

Once every request is decoding at its worker (the emulators'
``/emulator/stats`` ``gpu.decoding``) and ``--pause-at`` (0.5) of the decode
time has passed, the trainer syncs the weights:

1. ``t0``; ``POST /admin/pause {"mode": M}``; ``t1`` when it answers: the
   pause time is ``t1 - t0``;
2. on every worker ``POST /update_weights_from_disk {"model_path",
   "weight_version": "v2"}`` (``abort_all_requests`` false, ``flush_cache``
   true: SGLang's weight load, which flushes the radix cache as every
   weight update does; the emulator's ``/update_weight_version`` only
   relabels and keeps the cache);
3. ``--transfer-s`` (1.0) of sleep: the weight transfer the emulator does
   not model;
4. ``POST /admin/resume {"weight_version": "v2"}``.

Under ``drain`` the pause answers when the last turn has finished; under
``abort`` the server asks the workers to abort its requests
(``/abort_request`` by rid) and answers once they acknowledged, and after
resume continues each turn from prompt + partial ids: a second
``/generate`` that prefills the prompt and the partial again (the cache was
flushed). The trainer declares ``v1`` (``POST /admin/resume
{"weight_version": "v1"}``) before the batch, so an interrupted turn's
tokens are ``v1`` then ``v2``.

Modes alternate, ``--repeats`` (3) each, every run with fresh processes.
Checked (a failure stops the bench with what was seen and the logs, never a
reported success): every turn 200, not ``abort``, exactly
``--completion-tokens`` tokens, and its export in one of three shapes: not
interrupted (one ``v1`` span; under ``abort``: the turn finished before its
abort reached the worker), continued (one continuation, spans ``v1`` then
``v2``), or sampled afresh (one continuation with ``discarded_tokens``, one
``v2`` span: the server's answer to an abort that landed in the last decode
step, which keeps the stop token); ``drain``: not interrupted only. The
counts agree across sources: ``rollout_turns_interrupted_total`` by action
and the workers' ``aborted`` with the exports' continuations,
``rollout_reprefilled_tokens_total`` with their ``prompt_tokens -
cached_tokens``, one cache flush per worker.

Reported per mode, median and range: pause s (the trainer's wait), sync s
(pause to resume answered: the whole weight-sync step), batch s (first
request to last answer), after resume s (resume to last answer);
interrupted (the pause answer's ``interrupted``: requests it asked to
abort) and its ``waiting`` (turns whose aborted answer the server had
already taken in when the pause answered); continued, finished before the
abort, continued across the update (``v1`` → ``v2``), resampled and their
discarded tokens; the share of completion tokens sampled by ``v2``;
continuation prompt tokens and tokens re-prefilled; the mean wait of an
interrupted turn (``rollout_pause_wait_seconds``); the workers' prefill
tokens and ``/separate_reasoning`` calls (the emulators' ``parse_calls``).

    python benches/weight_updates.py
    python benches/weight_updates.py --agents 16 --repeats 1 --completion-tokens 500
    python benches/weight_updates.py --modes abort --repeats 1 --profile prof/
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio
from _common import (
    Child,
    Window,
    agent_client,
    bench_parser,
    child,
    children,
    emulator_command,
    load_average,
    profile,
    pyplot,
    save_figure,
    server_command,
    table,
    write_json,
)
from kv_sessions import words

MODES = ("drain", "abort")
TEMPLATE = ["--chat-template", "qwen3"]
SERVER_FLAGS = ["--engine", "sglang-generate", "--reasoning-parser", "qwen3", *TEMPLATE]
OLD, NEW = "v1", "v2"
_INTERRUPTED = "rollout_turns_interrupted_total"
_REPREFILLED = "rollout_reprefilled_tokens_total"
_WAIT = "rollout_pause_wait_seconds"
_ACTIONS = ("continued", "resampled", "returned", "failed")


class BenchFailure(RuntimeError):
    """The server or the emulator misbehaved: what was seen, for the report."""


# -- the agents -------------------------------------------------------------------


@dataclass
class Turn:
    """One agent's turn as it answered."""

    status: int = 0
    body: bytes = b""
    answered_at: float = 0.0  # time.perf_counter()


class Agent:
    def __init__(self, index: int, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
        self.index = index
        self.client = client
        self.args = args
        self.session_id = ""
        self.turn: Turn | None = None

    async def start(self, server: str) -> None:
        created = await self.client.post(f"{server}/sessions")
        if created.status_code not in (200, 201):
            raise BenchFailure(f"agent {self.index}: POST /sessions {created.status_code}")
        self.session_id = created.json()["session_id"]

    def body(self) -> dict[str, Any]:
        return {
            "messages": [
                {"role": "system", "content": "You are a careful assistant. Think first."},
                # "Task N:" first: each agent's prompt is its own after the system part.
                {
                    "role": "user",
                    "content": f"Task {self.index}: " + words(self.args.prompt_words, self.index),
                },
            ],
            "max_tokens": self.args.completion_tokens + 512,
            "seed": self.index,
        }

    async def send(self, server: str, done: list[int]) -> None:
        url = f"{server}/sessions/{self.session_id}/v1/chat/completions"
        response = await self.client.post(url, content=orjson.dumps(self.body()))
        self.turn = Turn(response.status_code, response.content, time.perf_counter())
        done.append(self.index)


async def _each(agents: list[Agent], call: Any) -> None:
    async with trio.open_nursery() as nursery:
        for agent in agents:
            nursery.start_soon(call, agent)


# -- control calls -------------------------------------------------------------------


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(url, content=orjson.dumps(body))
    if response.status_code != 200:
        raise BenchFailure(f"POST {url} {body}: {response.status_code} {response.text[:500]}")
    answer: dict[str, Any] = response.json()
    return answer


async def scrape(client: httpx.AsyncClient, server: str) -> dict[str, float]:
    """The server's /metrics as {"name{labels}": value}."""
    response = await client.get(f"{server}/metrics")
    response.raise_for_status()
    out = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def worker_stats(client: httpx.AsyncClient, workers: list[Child]) -> list[dict[str, Any]]:
    return [(await client.get(f"{w.url}/emulator/stats")).json() for w in workers]


async def wait_decoding(
    client: httpx.AsyncClient, workers: list[Child], agents: int, done: list[int], timeout_s: float
) -> None:
    """Until every agent's request is decoding at its worker (bounded)."""
    gpus: list[dict[str, Any]] = []
    with trio.move_on_after(timeout_s):
        while True:
            if done:
                raise BenchFailure(
                    f"agents {done} answered before every request was decoding: failed, "
                    "or turns too short for the prefill (raise --completion-tokens)"
                )
            gpus = [s["gpu"] for s in await worker_stats(client, workers)]
            decoding = sum(g["decoding"] for g in gpus)
            if decoding == agents and not sum(g["prefill_waiting"] for g in gpus):
                return
            await trio.sleep(0.02)
    raise BenchFailure(f"not all {agents} requests decoding after {timeout_s:.0f} s: {gpus}")


async def warm_up(server: str, client: httpx.AsyncClient, workers: int) -> None:
    """Short turns (cut at 16 tokens), not measured: imports, template, pools."""
    for i in range(2 * workers):
        session = (await client.post(f"{server}/sessions")).json()["session_id"]
        body = {"messages": [{"role": "user", "content": f"Warm up {i}."}], "max_tokens": 16}
        url = f"{server}/sessions/{session}/v1/chat/completions"
        response = await client.post(url, content=orjson.dumps(body))
        if response.status_code != 200:
            raise BenchFailure(f"warm-up turn: {response.status_code} {response.text[:500]}")
        (await client.delete(f"{server}/sessions/{session}")).raise_for_status()


# -- one run ----------------------------------------------------------------------------


async def run_once(mode: str, rep: int, args: argparse.Namespace) -> dict[str, Any]:
    flags = [
        "--engine", "sglang",
        "--reasoning", *TEMPLATE,
        "--gpu-contention",
        "--completion-tokens", str(args.completion_tokens),
        "--decode-s-per-token", str(args.decode_s_per_token),
        "--prefill-s-per-token", str(args.prefill_s_per_token),
        "--record-limit", "0",
        "--seed", "0",
    ]  # fmt: skip
    specs = [(f"worker{i}", emulator_command(*flags)) for i in range(args.workers)]
    async with children(specs) as workers:
        command = server_command([w.url for w in workers], *SERVER_FLAGS)
        async with child("server", command, marker="rollout-session listening on") as server:
            try:
                return await measure(mode, rep, server, workers, args)
            except BenchFailure as exc:
                logs = "\n".join(
                    f"--- {c.name} log ({c.log}):\n{c.log_tail(40)}" for c in [server, *workers]
                )
                raise BenchFailure(f"{mode} run {rep}: {exc}\n{logs}") from exc


async def measure(
    mode: str, rep: int, server: Child, workers: list[Child], args: argparse.Namespace
) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=120) as control:
        info = (await control.get(f"{workers[0].url}/get_model_info")).json()
        await warm_up(server.url, control, args.workers)
        await _post(control, f"{server.url}/admin/resume", {"weight_version": OLD})
        clients = [agent_client(timeout=600) for _ in range(args.agents)]
        agents = [Agent(i, c, args) for i, c in enumerate(clients)]
        try:
            await _each(agents, lambda a: a.start(server.url))
            metrics_before = await scrape(control, server.url)
            stats_before = await worker_stats(control, workers)
            done: list[int] = []
            trainer: dict[str, Any] = {}
            window = Window([server, *workers])
            began = time.perf_counter()
            failed: list[BenchFailure] = []
            async with trio.open_nursery() as nursery:
                for agent in agents:
                    nursery.start_soon(agent.send, server.url, done)
                try:
                    trainer = await sync(mode, rep, control, server, workers, info, done, args)
                except BenchFailure as exc:
                    failed.append(exc)
                    nursery.cancel_scope.cancel()
            if failed:
                answers = [(a.index, a.turn.status, a.turn.body[:300]) for a in agents if a.turn]
                raise BenchFailure(f"{failed[0]}; answers so far: {answers[:4]}") from failed[0]
            usage = window.finish()
            documents = []
            for agent in agents:
                url = f"{server.url}/sessions/{agent.session_id}/trajectory"
                # v1's document (the last segment at the top level), which
                # servers from before schema 3 answer too (they ignore ?schema=).
                exported = await control.get(url, params={"schema": 1})
                if exported.status_code != 200:
                    raise BenchFailure(f"GET {url}: {exported.status_code} {exported.text[:300]}")
                documents.append(exported.json())
            metrics_after = await scrape(control, server.url)
            stats_after = await worker_stats(control, workers)
        finally:
            for c in clients:
                await c.aclose()
    last = max(a.turn.answered_at for a in agents if a.turn is not None)
    interrupted = {
        action: _delta(metrics_after, metrics_before, f'{_INTERRUPTED}{{action="{action}"}}')
        for action in _ACTIONS
    }
    wait_n = _delta(metrics_after, metrics_before, f"{_WAIT}_count")
    wait_s = _delta(metrics_after, metrics_before, f"{_WAIT}_sum")
    try:
        checked = check(mode, agents, documents, args)
    except BenchFailure as exc:
        t0, t1 = trainer["t0"], trainer["t1"]
        answered = sorted(
            (round(a.turn.answered_at - t0, 3), a.index) for a in agents if a.turn is not None
        )
        calls = [
            (len(w["weights"]["aborts"]), sum(not c["ended"] for c in w["weights"]["aborts"]))
            for w in stats_after
        ]
        raise BenchFailure(
            f"{exc}\npause answered after {t1 - t0:.3f} s: {trainer['paused']}; per worker "
            f"(abort calls, calls that ended no request): {calls}; agents' answers, s after the "
            f"pause was sent (first 8): {answered[:8]}"
        ) from exc
    reprefilled = _delta(metrics_after, metrics_before, _REPREFILLED)
    if reprefilled != checked["reprefilled (exports)"]:
        raise BenchFailure(
            f"rollout_reprefilled_tokens_total moved by {reprefilled:.0f}, the exports' "
            f"continuations re-prefilled {checked['reprefilled (exports)']}"
        )
    # A turn sampled afresh counts as continued (its abort), then resampled.
    if (
        interrupted["continued"] != checked["continuations"]
        or interrupted["resampled"] != checked["resampled"]
        or interrupted["returned"]
        or interrupted["failed"]
    ):
        raise BenchFailure(
            f"interrupted turns by action {interrupted}, exports hold "
            f"{checked['continuations']} continuations"
        )
    if trainer["interrupted"] < checked["continuations"]:
        raise BenchFailure(
            f"the pause asked {trainer['interrupted']} requests to abort, "
            f"{checked['continuations']} turns were continued"
        )
    ended = sum(s["aborted"] for s in stats_after) - sum(s["aborted"] for s in stats_before)
    if ended != checked["continuations"]:
        raise BenchFailure(
            f"the workers aborted {ended} requests, the exports hold "
            f"{checked['continuations']} continuations"
        )
    flushes = sum(s["weights"]["cache_flushes"] for s in stats_after) - sum(
        s["weights"]["cache_flushes"] for s in stats_before
    )
    if flushes != args.workers:
        raise BenchFailure(f"{flushes} cache flushes on {args.workers} workers")
    recognised = sum(len(s["continued"]) for s in stats_after) - sum(
        len(s["continued"]) for s in stats_before
    )
    parses = sum(s["parse_calls"].get("separate_reasoning", 0) for s in stats_after) - sum(
        s["parse_calls"].get("separate_reasoning", 0) for s in stats_before
    )
    return {
        "mode": mode,
        "repeat": rep,
        "pause s": trainer["t1"] - trainer["t0"],
        "sync s": trainer["t3"] - trainer["t0"],
        "batch s": last - began,
        "after resume s": max(0.0, last - trainer["t3"]),
        "interrupted": trainer["interrupted"],
        "waiting at pause answer": trainer["paused"]["waiting"],
        "continued": int(interrupted["continued"]),
        "finished before abort": args.agents - checked["continuations"] if mode == "abort" else 0,
        "worker recognised": recognised,
        **checked,
        "reprefilled (metrics)": int(reprefilled),
        "mean wait s": wait_s / wait_n if wait_n else 0.0,
        "worker prefill tokens": sum(s["prefill_tokens"] for s in stats_after)
        - sum(s["prefill_tokens"] for s in stats_before),
        "separate_reasoning calls": parses,
        "pause answer": trainer["paused"],
        "foreign cores": usage["foreign_cores"],
    }


async def sync(
    mode: str,
    rep: int,
    control: httpx.AsyncClient,
    server: Child,
    workers: list[Child],
    info: dict[str, Any],
    done: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The trainer's weight sync once every turn is decoding: pause, update
    every worker, the transfer, resume. Times are time.perf_counter()."""
    prefill_s = args.prefill_s_per_token * (args.prompt_words + 64) * args.agents
    await wait_decoding(control, workers, args.agents, done, timeout_s=30 + 4 * prefill_s)
    async with contextlib.AsyncExitStack() as stack:
        if args.profile:
            # py-spy from before the wait (it takes a moment to attach) to the pause's answer.
            prof: Path = args.profile / f"weight-updates-{mode}-r{rep}"
            for c in [server, *workers]:
                await stack.enter_async_context(profile(c, prof / f"{c.name}.txt", rate=200))
        await trio.sleep(args.pause_at * args.completion_tokens * args.decode_s_per_token)
        t0 = time.perf_counter()
        paused = await _post(control, f"{server.url}/admin/pause", {"mode": mode})
        t1 = time.perf_counter()
    if mode == "drain" and paused["inflight"]:
        raise BenchFailure(f"drain answered {paused}")
    update = {"model_path": info["model_path"], "weight_version": NEW}
    for worker in workers:
        answer = await _post(control, f"{worker.url}/update_weights_from_disk", update)
        if not answer.get("success"):
            raise BenchFailure(f"{worker.url}/update_weights_from_disk: {answer}")
    await trio.sleep(args.transfer_s)
    t2 = time.perf_counter()
    await _post(control, f"{server.url}/admin/resume", {"weight_version": NEW})
    t3 = time.perf_counter()
    return {
        "t0": t0,
        "t1": t1,
        "t2": t2,
        "t3": t3,
        "interrupted": paused["interrupted"],
        "paused": paused,
    }


def check(
    mode: str, agents: list[Agent], documents: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """Every turn answered whole and recorded in one of three consistent
    shapes: not interrupted (one v1 span: under ``abort``, a turn that
    finished before its abort reached the worker), interrupted once and
    continued (spans v1 then v2), or interrupted once and sampled afresh
    (an abort that landed in the last decode step keeps the stop token: the
    server drops the partial, its ``discarded_tokens``, one v2 span); the
    last two under ``abort`` only. Returns what the exports say about
    continuations and versions."""
    problems: list[str] = []
    continuations = prompt_tokens = reprefilled = two_spans = new_tokens = total = 0
    resampled = discarded = 0
    for agent, doc in zip(agents, documents, strict=True):
        turn = agent.turn
        if turn is None or turn.status != 200:
            status = turn.status if turn else "no answer"
            problems.append(f"agent {agent.index}: {status} {turn.body[:300] if turn else ''!r}")
            continue
        answer = orjson.loads(turn.body)
        finish = answer["choices"][0]["finish_reason"]
        sampled = answer["usage"]["completion_tokens"]
        if finish == "abort" or sampled != args.completion_tokens:
            problems.append(f"agent {agent.index}: finish {finish}, {sampled} tokens")
        (t,) = doc["turns"]
        spans = [(s["version"], s["end"] - s["start"]) for s in t["weight_versions"]]
        versions = [v for v, _ in spans]
        n = t["completion_end"] - t["completion_start"]
        conts = t["continuations"]
        dropped = sum(c["discarded_tokens"] for c in conts)
        whole = (len(conts), versions) == (0, [OLD])
        interrupted = (len(conts), versions, dropped) == (1, [OLD, NEW], 0)
        afresh = len(conts) == 1 and versions == [NEW] and dropped > 0
        if (
            t["finish_reason"] == "abort"
            or n != args.completion_tokens
            or not (whole or interrupted or afresh)
            or (mode == "drain" and not whole)
        ):
            problems.append(
                f"agent {agent.index} export: finish {t['finish_reason']}, {n} tokens, "
                f"spans {t['weight_versions']}, continuations {conts}"
            )
        two_spans += interrupted
        resampled += afresh
        discarded += dropped
        new_tokens += sum(k for v, k in spans if v == NEW)
        total += n
        for c in conts:
            continuations += 1
            prompt_tokens += c["prompt_tokens"]
            reprefilled += c["prompt_tokens"] - (c["cached_tokens"] or 0)
    if problems:
        shown = "\n  ".join(problems[:10])
        raise BenchFailure(f"{len(problems)} of {len(agents)} turns wrong:\n  {shown}")
    return {
        "continuations": continuations,
        "turns v1→v2": two_spans,
        "resampled": resampled,
        "discarded tokens": discarded,
        "v2 tokens %": 100 * new_tokens / max(total, 1),
        "continuation prompt tokens": prompt_tokens,
        "reprefilled (exports)": reprefilled,
    }


# -- the report --------------------------------------------------------------------------


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def spread(values: list[float]) -> str:
    """Median and range."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return _num(values[0])
    return f"{_num(statistics.median(values))} ({_num(min(values))}–{_num(max(values))})"


_SUMMARY = [
    "pause s",
    "sync s",
    "batch s",
    "after resume s",
    "interrupted",
    "waiting at pause answer",
    "continued",
    "finished before abort",
    "turns v1→v2",
    "resampled",
    "discarded tokens",
    "v2 tokens %",
    "continuation prompt tokens",
    "reprefilled (metrics)",
    "mean wait s",
    "worker prefill tokens",
    "separate_reasoning calls",
    "foreign cores",
]
_RUN_COLUMNS = [
    "mode",
    "repeat",
    "pause s",
    "sync s",
    "batch s",
    "after resume s",
    "interrupted",
    "waiting at pause answer",
    "continued",
    "worker recognised",
    "finished before abort",
    "turns v1→v2",
    "resampled",
    "discarded tokens",
    "v2 tokens %",
    "continuation prompt tokens",
    "reprefilled (metrics)",
    "reprefilled (exports)",
    "mean wait s",
    "worker prefill tokens",
    "separate_reasoning calls",
    "foreign cores",
]


def summarise(runs: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        row: dict[str, Any] = {"mode": mode, "runs": len(mine)}
        for key in _SUMMARY:
            row[key] = spread([float(r[key]) for r in mine])
        rows.append(row)
    return rows


def plot(runs: list[dict[str, Any]], modes: list[str], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    keys = ("pause s", "sync s", "batch s")
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        mine = [r for r in runs if r["mode"] == mode]
        mids = [statistics.median(r[k] for r in mine) for k in keys]
        low = [m - min(r[k] for r in mine) for m, k in zip(mids, keys, strict=True)]
        high = [max(r[k] for r in mine) - m for m, k in zip(mids, keys, strict=True)]
        xs = [x + (i - (len(modes) - 1) / 2) * width for x in range(len(keys))]
        ax.bar(xs, mids, width, yerr=[low, high], capsize=3, label=mode)
    ax.set_xticks(range(len(keys)), ["trainer's pause", "pause → resumed", "batch"])
    ax.set_ylabel("seconds (median, range)")
    ax.legend()
    save_figure(fig, path)


async def main(args: argparse.Namespace) -> None:
    print(
        f"{load_average()}; {args.workers} emulator workers (qwen3, reasoning, GPU contention, "
        f"prefill {args.prefill_s_per_token} s/token, decode {args.decode_s_per_token} s/step), "
        f"{args.agents} agents x 1 turn of {args.completion_tokens} tokens after "
        f"~{args.prompt_words} prompt words; pause at {args.pause_at:.0%} of the decode, "
        f"transfer {args.transfer_s} s; modes {', '.join(args.modes)}, {args.repeats} repeats "
        f"(alternating)"
    )
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        order = args.modes if rep % 2 == 0 else args.modes[::-1]
        for mode in order:
            runs.append(await run_once(mode, rep, args))
            print(table([runs[-1]], _RUN_COLUMNS), flush=True)
    rows = summarise(runs, args.modes)
    print()
    print(load_average())
    print(table(runs, _RUN_COLUMNS))
    print()
    print("median (min–max) over repeats")
    print(table(rows, ["mode", "runs", *_SUMMARY]))
    write_json(
        args.json,
        {
            "args": {k: str(v) for k, v in vars(args).items()},
            "load": load_average(),
            "runs": runs,
            "summary": rows,
        },
    )
    if args.plot:
        plot(runs, args.modes, args.plot)


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--completion-tokens", type=int, default=2000)
    parser.add_argument("--decode-s-per-token", type=float, default=0.002)
    parser.add_argument("--prefill-s-per-token", type=float, default=2e-5)
    parser.add_argument("--prompt-words", type=int, default=1000, help="~1 token each")
    parser.add_argument(
        "--pause-at", type=float, default=0.5, help="fraction of the decode time before the pause"
    )
    parser.add_argument(
        "--transfer-s", type=float, default=1.0, help="trainer's weight transfer, update to resume"
    )
    parser.add_argument(
        "--profile", type=Path, help="py-spy the server and workers up to the pause's answer"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG: pause, sync and batch time per mode")
    arguments = parser.parse_args()
    if {*arguments.modes} - {*MODES}:
        parser.error(f"--modes: {', '.join(MODES)}")
    trio.run(main, arguments)
