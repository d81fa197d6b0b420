"""How the pool speaks to SGLang workers for the `sglang-generate` engine:
the SGLang dialect (`engines.sglang_workers`) probed on ``/generate``, the
route its turns take (a worker may serve no chat route:
``--skip-tokenizer-init``)."""

from __future__ import annotations

import uuid

import orjson

from ..answer import AnswerCheck
from ..pool.dialect import ANY_VOCAB, Probe
from ..sglang_workers import sglang_dialect
from .answer import check_generate_answer

__all__ = ["GENERATE_PATH", "SGLANG_GENERATE_WORKERS", "generate_probe_body"]

GENERATE_PATH = "/generate"
_PROBE_CHECK = AnswerCheck(sent_prompt_tokens=1, vocab_size=ANY_VOCAB)


def generate_probe_body(model: str) -> bytes:
    """One greedy token after a one-id prompt, with its logprob, as turns
    ask (``/generate`` serves the one model it runs: `model` is unused)."""
    del model
    return orjson.dumps(
        {
            "input_ids": [0],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
            "rid": uuid.uuid4().hex,
        }
    )


def _check_probe(body: bytes) -> object:
    return check_generate_answer(body, _PROBE_CHECK)


# Its answers are parsed on the same worker: it must serve the parse routes.
SGLANG_GENERATE_WORKERS = sglang_dialect(
    Probe(GENERATE_PATH, generate_probe_body, _check_probe), parses=True
)
