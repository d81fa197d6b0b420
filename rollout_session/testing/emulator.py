"""The SGLang emulator: configuration, per-server state, and chat handling.

Owns `EmulatorConfig`, the `Emulator` (one per app: tokenizer, fake model,
prefix cache, fault picker, and the counters/records tests inspect and wait
on), and the handling of one ``/v1/chat/completions`` call (request checks,
fault selection, cache lookup, latency, recording), independent of HTTP. The
Quart app, its routes and `start_emulator` live in `emulator_app`; what the
model samples and the response JSON in `generation`, the cache model in
`prefix_cache`, the latency (GPU time) model in `gpu`, errors and injected
faults in `faults`.
"""

from __future__ import annotations

import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import trio
from transformers import AutoTokenizer

from rollout_session.errors import InvalidRequest
from rollout_session.messages import normalize_messages
from rollout_session.testing.emulator_config import EmulatorConfig
from rollout_session.testing.faults import (
    EARLY_FAULTS,
    BadRequest,
    FaultPicker,
    Reply,
    context_length_message,
    early_fault_reply,
    fault_reply,
)
from rollout_session.testing.generation import (
    SampleSpec,
    Speaker,
    TextModel,
    choose_tools,
    derive_seed,
)
from rollout_session.testing.gpu import GpuModel
from rollout_session.testing.prefix_cache import PrefixCache
from rollout_session.testing.sglang_answer import chat_response, routed_experts_blob
from rollout_session.tokenization import ChatTokenizer, generation_stop_ids

__all__ = ["ChatRecord", "Emulator", "EmulatorConfig"]


@dataclass(frozen=True)
class ChatRecord:
    """One chat request as received: parsed JSON body (None if unparsable)."""

    body: Any
    arrival: float  # trio.current_time()
    fault: str | None
    session_id: str | None
    # Its headers, names lowercased (what a proxy in front passed on).
    headers: Mapping[str, str] = field(default_factory=dict)


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{key} must be an integer >= {minimum}")
    return value


def _session_of(body: dict[str, Any]) -> str | None:
    """SGLang's ``session_params.id``, or a plain ``session_id`` field."""
    params = body.get("session_params")
    sid = (params.get("id") if isinstance(params, dict) else None) or body.get("session_id")
    return sid if isinstance(sid, str) and sid else None


class Emulator:
    """State of one emulator server; tests reach it as ``app.extensions["emulator"]``."""

    def __init__(self, config: EmulatorConfig, model: TextModel | None = None) -> None:
        self.config = config
        self.model = model or TextModel(AutoTokenizer.from_pretrained(str(config.tokenizer_path)))
        self.speaker = Speaker(
            self.model,
            ChatTokenizer(
                self.model.tokenizer,
                config.chat_template,
                stop_ids=generation_stop_ids(config.tokenizer_path),
            ),
        )
        self.cache = PrefixCache(config.cache_capacity_tokens, config.cache_block_tokens)
        self.gpu = GpuModel(self.cache, on_change=self._notify)
        self.faults = FaultPicker(config.fault, config.fault_rate, config.seed)
        self.requests: deque[ChatRecord] = deque(maxlen=config.record_limit)
        self.received = 0
        self.inflight = 0
        self.completed = 0
        self.cancelled = 0  # handler cancelled before answering: the client went away
        self.endless_ended = 0  # endless_body answers stopped: the client went away
        self.faults_injected: Counter[str] = Counter()
        self.open_sessions: set[str] = set()
        self.sessions_opened: list[str] = []
        self.sessions_closed: list[str] = []
        self._changed = trio.Event()

    # -- observability -------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; re-checked after every state change."""
        while not predicate():
            await self._changed.wait()

    def note_endless_end(self) -> None:
        self.endless_ended += 1
        self._notify()

    async def wait_for_requests(self, n: int) -> None:
        await self.wait_until(lambda: self.received >= n)

    async def wait_for_completed(self, n: int) -> None:
        await self.wait_until(lambda: self.completed >= n)

    async def wait_for_cancelled(self, n: int) -> None:
        await self.wait_until(lambda: self.cancelled >= n)

    def stats(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "inflight": self.inflight,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "endless_ended": self.endless_ended,
            "faults_injected": dict(self.faults_injected),
            "open_sessions": sorted(self.open_sessions),
            "sessions_opened": self.sessions_opened,
            "sessions_closed": self.sessions_closed,
            "cache_used_tokens": self.cache.used_tokens,
            "gpu": self.gpu.stats(),
        }

    # -- sessions ------------------------------------------------------------

    def open_session(self, session_id: str) -> None:
        self.open_sessions.add(session_id)
        self.sessions_opened.append(session_id)
        self._notify()

    def close_session(self, session_id: str) -> None:
        self.open_sessions.discard(session_id)
        self.sessions_closed.append(session_id)
        self.cache.release_session(session_id)
        self._notify()

    # -- chat completions ----------------------------------------------------

    async def handle_chat(
        self, raw: bytes, fault_header: str | None, headers: Mapping[str, str] | None = None
    ) -> Reply:
        """One ``/v1/chat/completions`` call, counted as completed or cancelled."""
        self.inflight += 1
        self._notify()
        try:
            reply = await self._chat(raw, fault_header, headers or {})
        except trio.Cancelled:
            self.cancelled += 1
            raise
        else:
            self.completed += 1
            return reply
        finally:
            self.inflight -= 1
            self._notify()

    async def _chat(
        self, raw: bytes, fault_header: str | None, headers: Mapping[str, str]
    ) -> Reply:
        arrival = trio.current_time()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        session_id = _session_of(body) if isinstance(body, dict) else None
        try:
            fault = self.faults.pick(fault_header)
        except ValueError as exc:
            fault = None
            early: Reply | None = BadRequest(str(exc)).reply()
        else:
            early = None
        self.requests.append(ChatRecord(body, arrival, fault, session_id, headers))
        self.received += 1
        self._notify()
        if early is not None:
            return early
        if fault is not None:
            self.faults_injected[fault] += 1
        if fault is not None and fault in EARLY_FAULTS:
            return await early_fault_reply(fault)
        try:
            response = await self._complete(body, arrival, session_id)
        except BadRequest as exc:
            return exc.reply()
        if fault is None:
            return Reply(200, orjson.dumps(response))
        return fault_reply(fault, response, self.model.vocab_size)

    async def _complete(self, body: Any, arrival: float, session_id: str | None) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("stream"):
            raise BadRequest("the emulator does not stream; send stream: false")
        if body.get("n") not in (None, 1):
            raise BadRequest("n must be 1")
        tools = body.get("tools") or None
        if tools is not None and not (
            isinstance(tools, list)
            and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
            and all(isinstance(t["function"].get("name"), str) for t in tools)
        ):
            raise BadRequest("tools must be a list of {type: function, function: {name, ...}}")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        try:
            messages = normalize_messages(body["messages"]) if "messages" in body else []
        except InvalidRequest as exc:
            raise BadRequest(exc.message) from exc
        prompt = self._prompt_ids(body.get("input_ids"))
        max_tokens = _opt_int(body, "max_completion_tokens", 1) or _opt_int(body, "max_tokens", 1)
        cfg = self.config
        budget = max(1, cfg.context_length - len(prompt)) if max_tokens is None else max_tokens
        if len(prompt) + budget > cfg.context_length:
            raise BadRequest(context_length_message(cfg.context_length, len(prompt), budget))
        reasoning = cfg.reasoning and kwargs.get("enable_thinking", True) is not False
        seed = derive_seed(cfg.seed, _opt_int(body, "seed", -(2**63)), prompt)
        try:
            calls = choose_tools(
                tools, body.get("tool_choice"), messages, body.get("parallel_tool_calls") is True
            )
            sample = self.speaker.sample(
                SampleSpec(seed, budget, cfg.completion_tokens, calls, reasoning),
                messages,
                tools,
                kwargs,
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        start_len = _opt_int(body, "routed_experts_start_len", 0) or 0
        forwarded = len(prompt) + len(sample.ids) - 1  # the last sampled token is never forwarded
        if body.get("return_routed_experts") and start_len > forwarded:
            raise BadRequest(f"routed_experts_start_len {start_len} > {forwarded} positions")

        cached = await self.gpu.serve(cfg, prompt, sample.ids, session_id)

        routed = None
        if body.get("return_routed_experts") and cfg.return_routed_experts:
            routed = routed_experts_blob(
                (prompt + sample.ids)[:forwarded],
                start_len,
                layers=cfg.routed_experts_layers,
                top_k=cfg.routed_experts_top_k,
                num_experts=cfg.routed_experts_num_experts,
            )
        rid = body.get("rid")
        return chat_response(
            sample,
            rid=rid if isinstance(rid, str) else uuid.uuid4().hex,
            # SGLang echoes the request's `model` ("default" when it has none).
            model=body["model"] if isinstance(body.get("model"), str) else "default",
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            weight_version=cfg.weight_version,
            e2e_latency=trio.current_time() - arrival,
            routed_experts=routed,
            meta_info=body.get("return_meta_info") is True,
        )

    def _prompt_ids(self, ids: Any) -> list[int]:
        """The prompt: ``input_ids`` only. SGLang would render ``messages``
        itself; a session server must never rely on that (its prompt must be
        the trajectory's ids), so the emulator refuses to."""
        vocab = self.model.vocab_size
        if ids is None:
            raise BadRequest(
                "input_ids is required (the emulator never renders messages: the session "
                "server must send the trajectory's ids)"
            )
        if not (
            isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < vocab for t in ids)
        ):
            raise BadRequest(f"input_ids must be a non-empty list of ids in [0, {vocab})")
        return ids
