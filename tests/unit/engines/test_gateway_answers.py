"""What a turn takes from an answer that came through a gateway (smg): the
worker it names, the headers an agent gets, and routed experts that are
missing although asked for (docs/deploy.md#behind-smg-the-sglang-gateway)."""

from __future__ import annotations

import json
import logging

import orjson
import pytest

from rollout_session.engines.answer import AnswerCheck
from rollout_session.engines.pool.client import UpstreamReply, forwardable_headers, routed_worker
from rollout_session.engines.sglang_chat.answer import check_answer
from rollout_session.errors import UpstreamMalformed
from tests import FIXTURES

ANSWERS = json.loads((FIXTURES / "sglang_chat_answers.json").read_text())
VOCAB = 151_936  # Qwen's, the fixtures' model


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"X-SMG-Routed-Worker-Id", b"http://10.0.0.11:30000")], "http://10.0.0.11:30000"),
        ([(b"x-smg-routed-worker-id", b"http://w:8000@3")], "http://w:8000@3"),
        ([(b"content-type", b"application/json")], None),
        ([(b"x-smg-routed-worker-id", b"")], None),
        ([(b"x-smg-routed-worker-id", "http://wörker".encode())], None),
        ([(b"x-smg-routed-worker-id", b"http://w/" + b"a" * 4096)], None),
    ],
    ids=["smg", "data-parallel-rank", "absent", "empty", "not-ascii", "too-long"],
)
def test_routed_worker_is_the_gateways_header_when_plausible(
    headers: list[tuple[bytes, bytes]], expected: str | None
) -> None:
    assert routed_worker(headers) == expected


def test_a_malformed_routed_worker_header_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rollout_session"):
        assert routed_worker([(b"x-smg-routed-worker-id", b"\x01bad")]) is None
    assert any("x-smg-routed-worker-id" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("routed", "served_by"),
    [("http://10.0.0.11:30000", "http://10.0.0.11:30000"), (None, "http://gateway:30000")],
    ids=["behind-gateway", "direct"],
)
def test_a_turn_records_the_worker_the_gateway_routed_to(
    routed: str | None, served_by: str
) -> None:
    reply = UpstreamReply(200, [], b"", "http://gateway:30000", 0.1, routed_worker=routed)
    assert reply.served_by == served_by
    assert reply.worker == "http://gateway:30000"  # the pool's worker: its circuit


def test_agents_never_learn_the_routed_worker() -> None:
    headers = [
        (b"Content-Type", b"application/json"),
        (b"X-SMG-Routed-Worker-Id", b"http://10.0.0.11:30000"),
    ]
    assert forwardable_headers(headers) == [(b"content-type", b"application/json")]


def test_routed_experts_asked_for_and_missing_is_malformed() -> None:
    # Before: silently a dense model (no experts stored, the turn committed).
    body = orjson.dumps(ANSWERS["text_answer"])
    check = AnswerCheck(sent_prompt_tokens=42, vocab_size=VOCAB, experts_from=0)
    with pytest.raises(UpstreamMalformed) as caught:
        check_answer(body, check)
    assert caught.value.kind == "routed_experts"
    assert caught.value.status_code == 502
    assert "--routed-experts" in caught.value.message
    # Not asked for: no experts, no error.
    assert check_answer(body, AnswerCheck(sent_prompt_tokens=42, vocab_size=VOCAB))[1] is None
