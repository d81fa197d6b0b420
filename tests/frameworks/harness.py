"""What every framework test shares: the real server as a user starts it,
a recorder of the model calls a framework made, and the check that every
sampled token of every call is in the export.

The server is `rollout-session serve --demo` in a subprocess on port 0; the
URL is read from the line it prints once it listens. The recorder is an
httpx / httpx2 response hook on the framework's own HTTP client (or on
every client of the process, `Recorder.every_client`): it sees each model
call exactly as the framework received it. A chat completion carries the
sampled token ids and logprobs SGLang's `meta_info` carries
(`output_token_logprobs`), so the check compares ids, not just counts; a
Responses or Messages answer, or a streamed one, carries no ids, so its
turn is checked by its token count and its text.

`demo_servers` starts one server per engine (`ENGINES`), and
`check_same_across_engines` compares one episode run against each: the
engines are interchangeable only if the agent reads the same answers and the
trainer gets the same tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

__all__ = [
    "ENGINES",
    "DemoServer",
    "Episode",
    "ModelCall",
    "Recorder",
    "check_episode",
    "check_same_across_engines",
    "close_thread_loop",
    "demo_server",
    "demo_servers",
    "dump",
]

_LISTENING = re.compile(r"rollout-session listening on (http://\S+)")
# Start-up loads the tokenizer and checks the template: seconds, not minutes.
_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0
# `serve --engine`: the demo's SGLang emulator workers speak every SGLang
# route, and under vllm the demo starts vLLM emulators, so the same episode
# runs under each (the demo names the parsers of sglang-generate and vllm).
ENGINES = ("sglang-chat", "sglang-generate", "vllm")


def _serve_command() -> list[str]:
    """The console script of the environment running the tests (what `pip
    install` put there), else the same entry point through the interpreter."""
    script = Path(sys.executable).parent / "rollout-session"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from rollout_session.cli.main import main; main()"]


@dataclass
class DemoServer:
    url: str
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def create_session(self, metadata: dict[str, Any] | None = None) -> tuple[str, str]:
        """A new session: (its id, its OpenAI base URL)."""
        answer = httpx.post(f"{self.url}/sessions", json={"metadata": metadata or {}})
        answer.raise_for_status()
        body = answer.json()
        return str(body["session_id"]), self.url + str(body["base_url"])

    def close_session(self, session_id: str) -> dict[str, Any]:
        """The trajectory, as `DELETE /sessions/{id}` returns it, with each
        token's text (`pieces`: what a call without ids is checked by)."""
        answer = httpx.delete(
            f"{self.url}/sessions/{session_id}",
            params={"include": "turns,messages,pieces"},
            timeout=60.0,
        )
        answer.raise_for_status()
        doc: dict[str, Any] = answer.json()
        return doc


@contextmanager
def _started(flags: tuple[str, ...]) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`rollout-session serve --demo --port 0 FLAGS…` started (not yet
    listening) and its log, until the block ends."""
    with tempfile.TemporaryDirectory(prefix="rollout-frameworks-") as tmp:
        log_path = Path(tmp) / "serve.log"
        with log_path.open("wb") as log:
            command = [*_serve_command(), "serve", "--demo", "--host", "127.0.0.1", "--port", "0"]
            process = subprocess.Popen(
                [*command, *flags],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            try:
                yield process, log_path
            finally:
                _stop(process)


@contextmanager
def demo_server(*flags: str) -> Iterator[DemoServer]:
    """`rollout-session serve --demo --port 0 FLAGS…` until the block ends."""
    with _started(flags) as (process, log_path):
        yield DemoServer(_wait_listening(process, log_path), log_path)


@contextmanager
def demo_servers(*flags: str) -> Iterator[dict[str, DemoServer]]:
    """`demo_server(--engine E, FLAGS…)` for each of `ENGINES`, by engine,
    started side by side (a start-up is most of a server's cost here)."""
    with ExitStack() as stack:
        started = {
            engine: stack.enter_context(_started(("--engine", engine, *flags)))
            for engine in ENGINES
        }
        yield {
            engine: DemoServer(_wait_listening(process, log_path), log_path)
            for engine, (process, log_path) in started.items()
        }


def close_thread_loop() -> None:
    """Close the event loop a sync API left set as the thread's current
    loop (a sync `litellm.completion`, pydantic-ai's `run_sync`, the Agents
    SDK's `Runner.run_sync` leave theirs open): else its sockets are
    reported unclosed in whichever later test collects it, and the next
    sync API may pick up a loop that was shut down."""
    policy = asyncio.get_event_loop_policy()
    try:
        loop = policy.get_event_loop()
    except RuntimeError:  # none is set (after an earlier test set None)
        return
    loop.close()
    policy.set_event_loop(None)


def _wait_listening(process: subprocess.Popen[bytes], log_path: Path) -> str:
    assert process.stdout is not None
    # The server prints a handful of lines and then nothing: reading them
    # line by line ends at the URL, or at EOF if it failed to start.
    for raw in process.stdout:
        match = _LISTENING.search(raw.decode(errors="replace"))
        if match:
            return match.group(1)
    process.wait(_START_TIMEOUT_S)
    raise RuntimeError(
        f"serve --demo exited ({process.returncode}) before listening:\n"
        + log_path.read_text(errors="replace")[-4000:]
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()


# The model routes a framework may call, by how the path ends: the protocol
# of the call. Chat answers carry the sampled ids (SGLang's meta_info);
# Responses and Messages answers carry the count and the text only.
_PROTOCOLS = (
    ("/chat/completions", "chat"),
    ("/responses", "responses"),
    ("/messages", "messages"),
)
# What a protocol's request repeats when a client retries it.
_HISTORY_KEYS = {
    "chat": ("messages", "tools"),
    "responses": ("instructions", "input", "tools"),
    "messages": ("system", "messages", "tools"),
}


def _protocol(url: str) -> str | None:
    path = url.split("?", 1)[0]
    for suffix, protocol in _PROTOCOLS:
        if path.endswith(suffix):
            return protocol
    return None


@dataclass
class ModelCall:
    """One model call a framework made and the answer it received (a
    streamed answer is read back into the non-streamed shape)."""

    status: int
    request: dict[str, Any]
    response: dict[str, Any] | None
    protocol: str = "chat"

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = self.request.get("messages", [])
        return messages

    @property
    def completion_tokens(self) -> int:
        assert self.response is not None
        usage = self.response["usage"]
        key = "completion_tokens" if self.protocol == "chat" else "output_tokens"
        return int(usage[key])

    @property
    def sampled(self) -> tuple[list[int], list[float]] | None:
        """The sampled ids and their logprobs (SGLang's meta_info), which
        only a non-streamed chat answer carries."""
        assert self.response is not None
        if self.protocol != "chat" or "meta_info" not in self.response["choices"][0]:
            return None
        entries = self.response["choices"][0]["meta_info"]["output_token_logprobs"]
        return [int(e[1]) for e in entries], [float(e[0]) for e in entries]

    @property
    def text(self) -> str:
        """The answer's text (what the agent reads of it)."""
        assert self.response is not None
        if self.protocol == "chat":
            return str(self.response["choices"][0]["message"].get("content") or "")
        if self.protocol == "responses":
            items = self.response["output"]
            parts = [p for i in items if i["type"] == "message" for p in i["content"]]
            return "".join(p.get("text", "") for p in parts)
        blocks = self.response["content"]
        return "".join(b["text"] for b in blocks if b["type"] == "text")

    @property
    def answer(self) -> dict[str, Any]:
        """What the agent reads of a chat answer, less what is new on every
        call whatever the engine (ids, times; tool-call ids are random on
        SGLang's chat route, `serving_chat._process_tool_call_id`)."""
        assert self.protocol == "chat" and self.response is not None
        choice = self.response["choices"][0]
        message = choice["message"]
        calls = [
            (c["type"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ]
        usage = self.response["usage"]
        return {
            "status": self.status,
            "finish_reason": choice["finish_reason"],
            "content": message.get("content"),
            "reasoning_content": message.get("reasoning_content"),
            "tool_calls": calls,
            "usage": (usage["prompt_tokens"], usage["completion_tokens"]),
        }

    @property
    def empty_answer(self) -> bool:
        """An answer with neither text nor tool calls (reasoning at most)."""
        assert self.response is not None
        if self.protocol == "chat":
            message = self.response["choices"][0]["message"]
            return not message.get("content") and not message.get("tool_calls")
        if self.protocol == "responses":
            calls = [i for i in self.response["output"] if i["type"] == "function_call"]
        else:
            calls = [b for b in self.response["content"] if b["type"] == "tool_use"]
        return not self.text and not calls

    def retries(self, previous: ModelCall) -> bool:
        """The same request as `previous`, whose answer had something in it:
        a retry (the agent never saw that answer), so the server replaces
        that turn instead of keeping it. Asked again after an empty answer,
        the agent saw it and dropped it: a new segment keeps it."""
        keys = _HISTORY_KEYS[self.protocol]
        same = self.protocol == previous.protocol and all(
            self.request.get(k) == previous.request.get(k) for k in keys
        )
        return same and not previous.empty_answer


def _sse_events(content: bytes) -> list[dict[str, Any]]:
    events = []
    for line in content.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:]))
    return events


def _read_stream(protocol: str, content: bytes) -> dict[str, Any]:
    """A streamed answer in the non-streamed shape: what the check reads."""
    events = _sse_events(content)
    if protocol == "responses":
        done = [e for e in events if e["type"] == "response.completed"]
        assert len(done) == 1, [e["type"] for e in events]
        answer: dict[str, Any] = done[0]["response"]
        return answer
    if protocol == "messages":
        start = next(e for e in events if e["type"] == "message_start")["message"]
        blocks: list[dict[str, Any]] = []
        for e in events:
            if e["type"] == "content_block_start":
                blocks.append({**e["content_block"], "text": ""})
            elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
                blocks[e["index"]]["text"] += e["delta"]["text"]
        usage = [e["usage"] for e in events if e["type"] == "message_delta"]
        return {**start, "content": blocks, "usage": {**start["usage"], **usage[-1]}}
    text, tool_calls, usage_chunk = "", False, None
    for chunk in events:
        for choice in chunk.get("choices", []):
            text += choice["delta"].get("content") or ""
            tool_calls = tool_calls or bool(choice["delta"].get("tool_calls"))
        usage_chunk = chunk.get("usage") or usage_chunk
    message: dict[str, Any] = {"content": text, "tool_calls": [{}] if tool_calls else None}
    return {"choices": [{"message": message}], "usage": usage_chunk}


class _Response(Protocol):
    """What the recorder reads of an httpx or httpx2 response."""

    status_code: int
    content: bytes
    headers: Any

    @property
    def request(self) -> Any: ...


@dataclass
class Recorder:
    """Every model call answer the framework's HTTP client received."""

    calls: list[ModelCall] = field(default_factory=list)

    def _record(self, response: _Response) -> None:
        request = response.request
        protocol = _protocol(str(request.url))
        if protocol is None or request.method != "POST":
            return
        body = json.loads(request.content)
        answer: dict[str, Any] | None
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            answer = _read_stream(protocol, response.content)
        else:
            try:
                answer = json.loads(response.content)
            except ValueError:
                answer = None
        if response.status_code == 200 and (answer is None or not answer.get("usage")):
            raise AssertionError(
                f"a 200 answer without usage (stream={body.get('stream')}): "
                f"{response.content[:200]!r}"
            )
        self.calls.append(ModelCall(response.status_code, body, answer, protocol))

    def sync_hook(self, response: Any) -> None:
        response.read()
        self._record(response)

    async def async_hook(self, response: Any) -> None:
        await response.aread()
        self._record(response)

    def take(self) -> list[ModelCall]:
        """The calls recorded since the last take (one episode's)."""
        calls, self.calls = self.calls, []
        return calls

    @contextmanager
    def every_client(self) -> Iterator[Recorder]:
        """Record what *any* httpx or httpx2 client of this process receives
        in the block: for code that builds its own clients (a snippet of
        docs/agents.md runs as a user would write it, with no hook)."""
        import httpx2

        recorder = self
        originals: list[tuple[Any, Any]] = []
        for module in (httpx, httpx2):
            sync_send, async_send = module.Client.send, module.AsyncClient.send

            def send(client: Any, request: Any, *a: Any, _send: Any = sync_send, **k: Any) -> Any:
                response = _send(client, request, *a, **k)
                recorder.sync_hook(response)
                return response

            async def asend(
                client: Any, request: Any, *a: Any, _send: Any = async_send, **k: Any
            ) -> Any:
                response = await _send(client, request, *a, **k)
                await recorder.async_hook(response)
                return response

            originals += [(module.Client, sync_send), (module.AsyncClient, async_send)]
            module.Client.send = send
            module.AsyncClient.send = asend
        try:
            yield self
        finally:
            for cls, original in originals:
                cls.send = original


@dataclass
class Episode:
    """What one episode did and what the export shows, for the report."""

    framework: str
    calls: int
    ok_calls: int
    retries: int
    turns: int
    segments: int
    reasons: Counter[str]
    rollbacks: Counter[str]

    def line(self) -> str:
        reasons = ", ".join(f"{r}×{n}" for r, n in sorted(self.reasons.items())) or "-"
        rollbacks = ", ".join(f"{r}×{n}" for r, n in sorted(self.rollbacks.items())) or "-"
        return (
            f"{self.framework}: {self.calls} calls ({self.ok_calls} × 200), "
            f"{self.turns} turns in {self.segments} segment(s); "
            f"new segments: {reasons}; rollbacks: {rollbacks}"
        )


# What each check_same_across_engines compared, for the report.
PARITY: list[str] = []

# Set by conftest from --frameworks-dump: where each episode's calls and
# export are written (to read what a framework did).
DUMP_DIR: list[Path] = []


def dump(framework: str, calls: list[ModelCall], doc: dict[str, Any]) -> None:
    """With --frameworks-dump DIR: the episode's requests, answers and export
    as DIR/FRAMEWORK-SESSION.json."""
    if not DUMP_DIR:
        return
    record = {
        "calls": [
            {"status": c.status, "request": c.request, "response": c.response} for c in calls
        ],
        "export": doc,
    }
    path = DUMP_DIR[0] / f"{framework}-{doc['session_id']}.json"
    path.write_text(json.dumps(record, indent=1))


def check_episode(framework: str, calls: list[ModelCall], doc: dict[str, Any]) -> Episode:
    """Every sampled token of every 200 call is in `doc`, in order.

    The export's turns over all segments, in segment order, are exactly the
    200 calls in the order they were made, less each call that the next one
    retried (`ModelCall.retries`: the server replaces that turn, recorded under
    `rollbacks` with reason `retry`, with its sampled tokens as
    `dropped_tokens`). Each turn's sampled ids and logprobs
    are those of its call, with mask 1 (a call without ids: as many tokens
    as its usage says, decoding to its text); the mask-1 tokens of all
    segments add up to the calls' completion tokens.
    """
    assert doc["schema_version"] == 3, doc["schema_version"]
    ok = [c for c in calls if c.status == 200]
    replaced = [prev for prev, nxt in itertools.pairwise(ok) if nxt.retries(prev)]
    kept = [c for c in ok if not any(c is r for r in replaced)]
    segments: list[dict[str, Any]] = doc["segments"]
    assert doc["num_segments"] == len(segments) >= 1

    exported: list[tuple[list[int], list[float], list[int], str | None]] = []
    for segment in segments:
        ids, mask, logprobs = segment["token_ids"], segment["loss_mask"], segment["logprobs"]
        pieces: list[str] | None = segment.get("pieces")
        assert len(ids) == len(mask) == len(logprobs), segment["index"]
        turns = segment["turns"]
        if turns:
            assert segment["prompt_length"] == turns[0]["completion_start"]
        for turn in turns:
            start, end = turn["completion_start"], turn["completion_end"]
            text = None if pieces is None else "".join(pieces[start:end])
            exported.append((ids[start:end], logprobs[start:end], mask[start:end], text))

    retry_rollbacks = [r for r in doc["rollbacks"] if r["reason"] == "retry"]
    assert sum(r["dropped_turns"] for r in retry_rollbacks) == len(replaced), (
        f"{len(replaced)} calls repeated by the next one, export rollbacks: {doc['rollbacks']}"
    )
    assert sum(r["dropped_tokens"] for r in retry_rollbacks) == sum(
        c.completion_tokens for c in replaced
    ), doc["rollbacks"]
    assert len(exported) == len(kept), (
        f"{len(kept)} model calls kept, {len(exported)} turns exported "
        f"({len(ok)} × 200, {len(replaced)} retried)"
    )
    for i, (call, (ids, logprobs, mask, text)) in enumerate(zip(kept, exported, strict=True)):
        sampled = call.sampled
        if sampled is not None:
            call_ids, call_logprobs = sampled
            assert len(call_ids) == call.completion_tokens, i
            assert ids == call_ids, f"call {i}: exported ids differ from the sampled ids"
            assert logprobs == call_logprobs, f"call {i}: exported logprobs differ"
        else:
            # No ids on this protocol's wire: the turn has the call's count
            # of tokens, each with its logprob, and decodes to its text.
            assert len(ids) == call.completion_tokens, f"call {i}: token count differs"
            assert text is not None, "an id-less call needs the export's pieces"
            assert call.text.strip() in text, f"call {i}: {call.text!r} not in {text!r}"
        assert all(m == 1 for m in mask), f"call {i}: a sampled token with mask 0"
    mask_ones = sum(sum(s["loss_mask"]) for s in segments)
    assert mask_ones == sum(c.completion_tokens for c in kept)

    reasons = Counter(s["branch"]["reason"] for s in segments if s["branch"] is not None)
    return Episode(
        framework,
        calls=len(calls),
        ok_calls=len(ok),
        retries=len(replaced),
        turns=len(exported),
        segments=len(segments),
        reasons=reasons,
        rollbacks=Counter(r["reason"] for r in doc["rollbacks"]),
    )


def _trajectory(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """What a trainer takes of an export, segment by segment."""
    keep = ("token_ids", "logprobs", "loss_mask", "branch")
    return [{k: segment[k] for k in keep} for segment in doc["segments"]]


def _same_prompts(calls: list[ModelCall]) -> int:
    """How many calls, from the first, have prompts whose text carries no
    tool-call id of an earlier answer. Tool-call ids are random on SGLang's
    chat route and on sglang-generate (`serving_chat._process_tool_call_id`;
    the emulator's chat route seeds them), so a prompt that quotes one (a
    framework that writes the calls into its text, a summary of the history)
    differs across engines, and the model samples another answer for it. The
    templates the demo runs (chatml, qwen3) render no id themselves."""
    ids: set[str] = set()
    for i, call in enumerate(calls):
        text = json.dumps([m.get("content") for m in call.messages])
        if any(known in text for known in ids):
            return i
        if call.response is not None and call.status == 200:
            for tool_call in call.response["choices"][0]["message"].get("tool_calls") or []:
                ids.add(tool_call["id"])
    return len(calls)


def check_same_across_engines(
    framework: str, runs: Mapping[str, tuple[list[ModelCall], dict[str, Any]]]
) -> int:
    """One episode run under each engine (`runs`: engine → its chat calls
    and export): every call got the same answer, as the agent reads it
    (`ModelCall.answer`), and the exports hold the same segments (token ids,
    logprobs, loss mask, why each began) and rollbacks. When a prompt quotes
    a random tool-call id (`_same_prompts`), the runs can part from that
    call on: only the calls before it are compared, and not the exports.
    Returns how many calls were compared."""
    (first, (calls, doc)), *others = runs.items()
    same = _same_prompts(calls)
    for engine, (other_calls, other_doc) in others:
        where = f"{framework}: {engine} vs {first}"
        assert len(other_calls) == len(calls) or same < len(calls), f"{where}: number of calls"
        assert len(other_calls) >= same, f"{where}: {len(other_calls)} calls, not {same}"
        for i, (one, other) in enumerate(zip(calls[:same], other_calls[:same], strict=True)):
            assert other.answer == one.answer, f"{where}: call {i} answered differently"
        if same < len(calls):
            PARITY.append(
                f"{where}: the first {same} of {len(calls)} calls "
                "(the next prompt quotes a tool-call id)"
            )
            continue
        segments, other_segments = _trajectory(doc), _trajectory(other_doc)
        assert len(other_segments) == len(segments), f"{where}: number of segments"
        for i, (one_segment, other_segment) in enumerate(
            zip(segments, other_segments, strict=True)
        ):
            for key, value in one_segment.items():
                assert other_segment[key] == value, f"{where}: segment {i} {key} differs"
        rollbacks = [{k: v for k, v in r.items() if k != "created_at"} for r in doc["rollbacks"]]
        other_rollbacks = [
            {k: v for k, v in r.items() if k != "created_at"} for r in other_doc["rollbacks"]
        ]
        assert other_rollbacks == rollbacks, f"{where}: rollbacks differ"
        PARITY.append(f"{where}: all {len(calls)} calls and the export")
    return same
