"""How the pool speaks to SGLang workers for the `sglang-chat` engine: the
SGLang dialect (`engines.sglang_workers`) probed on the chat route."""

from __future__ import annotations

import uuid

import orjson

from ..pool.dialect import ANY_VOCAB, Probe
from ..sglang_workers import sglang_dialect
from .answer import parse_worker_answer

__all__ = ["CHAT_PATH", "SGLANG_CHAT_WORKERS", "chat_probe_body"]

CHAT_PATH = "/v1/chat/completions"


def chat_probe_body(model: str) -> bytes:
    """A one-token chat completion asked the way turns ask (a one-id prompt),
    which checks the worker's chat route end to end, answer included."""
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "ping"}],
            "input_ids": [0],
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": True,
            "return_meta_info": True,
            "stream": False,
            "rid": uuid.uuid4().hex,
        }
    )


def _check_probe(body: bytes) -> object:
    return parse_worker_answer(body, sent_prompt_tokens=1, vocab_size=ANY_VOCAB)


SGLANG_CHAT_WORKERS = sglang_dialect(Probe(CHAT_PATH, chat_probe_body, _check_probe))
