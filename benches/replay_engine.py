"""An engine that replays completions in-process: `ReplayEngine`.

For benches and tests that drive the real turn runner (`TurnRunner.run`:
claim, parse, plan, the engine, commit) without a worker, a pool or HTTP.
Each request's completion is what a function the caller gives returns for
it, a `Replay`:

- `Replay.of_text`: a text (or tool-call) answer as a model trained on the
  chat template samples it (`prompt.model_output.answer_ids`, as the
  emulator and `check-template` do);
- `Replay.of_answer`: a recorded worker answer (the emulator's, SGLang's),
  validated for this request as the ``sglang-chat`` engine validates it
  (`check_answer`): fresh arrays every time, and the agent is answered with
  the recorded body itself.

It replays, it does not sample: the ids, logprobs and message are exactly
what the function gives, whatever the request asks for (sampling
parameters, ``max_tokens``). It cannot continue a partial completion. The
function may also return a `Refusal` (a worker's own error answer) or raise
the error tree's `UpstreamError` family, as an engine does. Production never
imports this module.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import orjson

from rollout_session.engines.answer import AnswerCheck
from rollout_session.engines.base import (
    AgentReply,
    CannotContinue,
    Completion,
    EngineCounter,
    EngineRequest,
    EngineSession,
    Refusal,
)
from rollout_session.engines.sglang_chat.answer import check_answer
from rollout_session.prompt.messages import Message, assistant_message
from rollout_session.prompt.model_output import answer_ids
from rollout_session.tokens import IdArray, LogprobArray, VersionSpan

if TYPE_CHECKING:
    from rollout_session.prompt.tokenizer import ChatTokenizer

__all__ = ["Replay", "ReplayEngine", "ReplaySource"]

_JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass(frozen=True, slots=True, kw_only=True)
class Replay:
    """One completion to replay: what the engine returns for a request."""

    ids: IdArray  # the sampled ids, in order
    logprobs: LogprobArray  # one per id
    # The assistant message: ``content``, ``tool_calls`` (each with ``id``
    # and ``function``: ``name``, ``arguments``), ``reasoning_content``.
    message: Message
    finish_reason: str | None = "stop"
    model: str | None = None  # None: the session keeps the model it has
    weight_version: str | None = None
    cached_tokens: int | None = None
    experts: tuple[bytes, int] | None = None  # R3: int32 bytes and values per position
    # The agent's answer as recorded (a worker's body); None: an OpenAI chat
    # completion is built from the fields above.
    body: bytes | None = None

    @classmethod
    def of_text(
        cls,
        tokenizer: ChatTokenizer,
        messages: Sequence[Message],
        answer: Message,
        *,
        tools: list[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        logprob: float = -0.5,
    ) -> Replay:
        """`answer` (an assistant message) sampled after `messages`: the
        template's own tokens of it up to its stop token, each with `logprob`."""
        ids = answer_ids(tokenizer, messages, answer, tools=tools, kwargs=kwargs or {})
        return cls(
            ids=np.asarray(ids, np.int32),
            logprobs=np.full(len(ids), logprob, np.float32),
            message=answer,
            finish_reason="tool_calls" if answer.get("tool_calls") else "stop",
        )

    @classmethod
    def of_answer(cls, body: bytes, request: EngineRequest) -> Replay:
        """A worker's recorded 200 body, checked against `request` as the
        ``sglang-chat`` engine checks an answer (`UpstreamMalformed` if bad)."""
        answer, experts = check_answer(
            body,
            AnswerCheck.of(request),
        )
        return cls(
            ids=answer.ids,
            logprobs=answer.logprobs,
            message=assistant_message(answer.content, answer.tool_calls, answer.reasoning_content),
            finish_reason=answer.finish_reason,
            model=answer.model,
            weight_version=answer.weight_version,
            cached_tokens=answer.cached_tokens,
            experts=experts,
            body=body,
        )

    def completion(
        self, prompt_tokens: int, *, worker: str = "replay", latency_s: float = 0.0
    ) -> Completion:
        """What an engine returns for it, after a prompt of `prompt_tokens`
        (`turn.runner.sampled` of it is what the turn commits)."""
        message = self.message
        body = self.body if self.body is not None else _chat_completion(self, prompt_tokens)
        return Completion(
            ids=self.ids,
            logprobs=self.logprobs,
            content=message.get("content"),
            tool_calls=list(message.get("tool_calls") or []),
            reasoning_content=message.get("reasoning_content"),
            finish_reason=self.finish_reason,
            model=self.model,
            weight_versions=(VersionSpan(0, len(self.ids), self.weight_version),)
            if len(self.ids)
            else (),
            cached_tokens=self.cached_tokens,
            experts=self.experts,
            worker=worker,
            latency_s=latency_s,
            reply=AgentReply(200, list(_JSON_HEADERS), body),
        )


# What the engine asks for each request: the completion to replay, or the
# worker error the agent gets instead.
ReplaySource = Callable[[EngineSession, EngineRequest], Replay | Refusal]


@dataclass(slots=True)
class ReplayEngine:
    """The engine seam (`engines.base.Engine`) over a `ReplaySource`."""

    source: ReplaySource
    worker: str = "replay"  # the worker every completion names (and sessions pin)
    # Latency each completion reports (the turn metrics observe it).
    latency_s: float = 0.0

    can_continue: ClassVar[bool] = False

    async def complete(
        self, session: EngineSession, request: EngineRequest
    ) -> Completion | Refusal:
        if request.partial is not None:
            raise CannotContinue("a replay engine cannot continue a partial completion")
        replay = self.source(session, request)
        if isinstance(replay, Refusal):
            return replay
        if session.worker is None:
            session.worker = self.worker
        return replay.completion(
            len(request.input_ids), worker=self.worker, latency_s=self.latency_s
        )

    async def prepare(self, tokenizer: ChatTokenizer) -> None:
        """Nothing to read: it replays."""

    def counters(self) -> Iterable[EngineCounter]:
        return ()

    def adopt(self, session: EngineSession) -> None:
        """A restored session keeps its pin; nothing else is held."""

    def release(self, session: EngineSession) -> None:
        session.worker = None

    async def close_worker_sessions(self, sessions: Iterable[EngineSession]) -> None:
        """Nothing is held on a replayed worker."""


def _chat_completion(replay: Replay, prompt_tokens: int) -> bytes:
    """An OpenAI chat completion of `replay` (the shape SGLang answers with,
    without its ``meta_info``)."""
    message = replay.message
    calls = [
        {
            "id": call.get("id"),
            "type": "function",
            "function": {
                "name": call["function"]["name"],
                "arguments": _arguments(call["function"].get("arguments", "{}")),
            },
        }
        for call in message.get("tool_calls") or []
    ]
    sampled = len(replay.ids)
    return orjson.dumps(
        {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": replay.model or "replay",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": message.get("content"),
                        "reasoning_content": message.get("reasoning_content"),
                        "tool_calls": calls or None,
                    },
                    "logprobs": None,
                    "finish_reason": replay.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": sampled,
                "total_tokens": prompt_tokens + sampled,
                "prompt_tokens_details": {"cached_tokens": replay.cached_tokens},
            },
        }
    )


def _arguments(arguments: Any) -> str:
    """OpenAI sends a call's arguments as a JSON string."""
    return arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
