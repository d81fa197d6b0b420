"""Property: whatever an agent does to its history — extend, retry, edit,
drop an answer, compact — no sampled token is lost and every segment is what
the template renders (docs/training.md#segments).

Drives `plan_turn` and `commit_turn` directly (no HTTP) with a model that
samples the template's own tokenisation of a text answer, so each segment's
ids must equal the ChatML render of its conversation exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_session.prompt.messages import Message, assistant_message
from rollout_session.prompt.model_output import answer_ids
from rollout_session.prompt.tokenizer import ChatTokenizer
from rollout_session.session.commit import Sampled, commit_turn
from rollout_session.session.segments import Divergence
from rollout_session.session.session import Session, TurnSlot
from rollout_session.turn.plan import TurnPolicy, plan_turn
from rollout_session.turn.request import parse_chat_request

POLICY = TurnPolicy(
    append_roles=frozenset({"tool", "user", "system"}),
    max_rollback_turns=1,
    chat_template_kwargs={},
)
OPS = ("extend", "retry", "edit", "drop", "compact", "system")


@dataclass
class Episode:
    """The agent's side: what it sends, every answer it got."""

    session: Session = field(default_factory=lambda: Session("s", {}, 0.0, 0.0))
    request: list[Message] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    replaced: int = 0  # answers a retry replaced
    step: int = 0

    def turn(self, tok: ChatTokenizer, messages: list[Message]) -> Message:
        self.step += 1
        request = parse_chat_request(orjson.dumps({"model": "m", "messages": messages}))
        plan = plan_turn(self.session, request, tok, POLICY)
        if plan.rollback is not None:
            assert plan.rollback.reason is Divergence.RETRY
            self.replaced += 1
            self.answers.pop()
        answer: Message = {"role": "assistant", "content": f"answer {self.step}."}
        ids = answer_ids(tok, messages, answer, tools=None, kwargs={})
        sampled = Sampled(
            ids=np.asarray(ids, np.int32),
            logprobs=np.full(len(ids), -0.5, np.float32),
            message=assistant_message(str(answer["content"]), [], None),
            finish_reason="stop",
            model=None,
            weight_version=None,
            cached_tokens=None,
            worker="http://w",
            latency_s=0.0,
        )
        slot = TurnSlot(started_at=0.0)
        self.session.slot = slot
        commit_turn(self.session, slot, plan, sampled, float(self.step))
        self.session.slot = None
        self.answers.append(ids)
        self.request = messages
        return answer


def next_request(op: str, episode: Episode, answer: Message, n: int) -> list[Message]:
    """The agent's next request after `answer` to `episode.request`."""
    sent = episode.request
    if op == "retry":
        return sent
    if op == "drop":
        return [*sent, {"role": "user", "content": f"No answer found {n}."}]
    if op == "edit":
        return [{**sent[0], "content": f"{sent[0]['content']} (edited {n})"}, *sent[1:]]
    if op == "compact":
        return [{"role": "user", "content": f"Summary {n}."}, {"role": "user", "content": "Go."}]
    role = "system" if op == "system" else "user"
    return [*sent, answer, {"role": role, "content": f"next {n}"}]


def render(hf: Any, tok: ChatTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    text = hf.apply_chat_template(messages, chat_template=tok.chat_template, tokenize=False)
    ids: list[int] = hf(text, add_special_tokens=False)["input_ids"]
    return ids


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=7))
def test_no_sampled_token_is_lost_and_segments_are_renders(
    hf_tokenizer: Any, chat_tokenizers: dict[str, ChatTokenizer], ops: list[str]
) -> None:
    tok = chat_tokenizers["chatml"]
    episode = Episode()
    answer = episode.turn(tok, [{"role": "user", "content": "Start."}])
    for n, op in enumerate(ops):
        answer = episode.turn(tok, next_request(op, episode, answer, n))
    session = episode.session
    completions = []
    for segment in session.segments():
        trajectory = segment.trajectory
        assert trajectory.check() is None
        ids = trajectory.tokens.ids.tolist()
        completions += [ids[t.completion_start : t.completion_end] for t in trajectory.turns]
        # ChatML rewrites nothing: the segment is the render of its
        # conversation, up to the "\n" the template puts after the last answer.
        expected = render(hf_tokenizer, tok, segment.conversation.messages())
        assert ids == expected[: len(ids)] and len(expected) - len(ids) == 1
    assert completions == episode.answers
    assert session.trajectory.tokens.num_sampled + sum(
        s.trajectory.tokens.num_sampled for s in session.earlier
    ) == sum(map(len, episode.answers))
    assert len(session.rollbacks) == episode.replaced
