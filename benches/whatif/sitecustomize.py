"""What-if patches for the session server, to measure proposed changes before
making them (benchmark experiments only; the package itself is not changed).

Python imports ``sitecustomize`` at start-up from ``sys.path``; with this
directory on ``PYTHONPATH`` and ``ROLLOUT_WHATIF`` set, a ``rollout-session
serve`` process (and no other) patches itself:

- ``inline``: run every offloaded step on the event loop (no thread hop);
- ``gate``: run large steps on the loop one at a time (a CapacityLimiter(1)
  and a checkpoint first), so a burst of large answers cannot hold the loop for
  many parses in one scheduling batch;
- ``process``: validate large worker answers in worker processes
  (``trio-parallel``), off the GIL;
- ``freeze``: ``gc.collect(); gc.freeze()`` once the tokenizer is loaded, so
  full collections no longer walk the ~110k start-up objects (~55 ms each);
- ``notext``: the answer decoder's entries without the ``text`` field (msgspec
  ignores trailing array items) and with ``gc=False``.

    ROLLOUT_WHATIF=freeze,notext,process PYTHONPATH=benches/whatif \\
        .venv/bin/python benches/large_turns.py --variants logprobs --upstreams replay

Needs ``pip install trio-parallel`` for ``process``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_WHATIF = frozenset(filter(None, os.environ.get("ROLLOUT_WHATIF", "").split(",")))


def validate_in_worker(body: bytes, sent: int, vocab: int) -> tuple[Any, ...]:
    """`parse_worker_answer` in a worker process; errors come back as data
    (the package's exceptions take keyword-only arguments and do not pickle)."""
    from rollout_session.errors import UpstreamMalformed
    from rollout_session.validation import parse_worker_answer

    try:
        return ("ok", parse_worker_answer(body, sent_prompt_tokens=sent, vocab_size=vocab))
    except UpstreamMalformed as exc:
        return ("error", exc.message, exc.kind)


def _patch() -> None:
    import functools
    import gc
    from typing import Annotated

    import msgspec
    import trio

    import rollout_session.app as app
    import rollout_session.context as context
    import rollout_session.validation as validation
    from rollout_session.errors import UpstreamMalformed

    sys.stderr.write(f"ROLLOUT_WHATIF {sorted(_WHATIF)}\n")
    gates: list[trio.CapacityLimiter] = []

    async def offload(self: Any, nbytes: int, fn: Any, *args: Any, **kw: Any) -> Any:
        call = functools.partial(fn, *args, **kw)
        if nbytes <= self.settings.offload_threshold_bytes:
            return call()
        if "process" in _WHATIF and fn.__name__ == "parse_worker_answer":
            import trio_parallel

            result = await trio_parallel.run_sync(
                validate_in_worker, args[0], kw["sent_prompt_tokens"], kw["vocab_size"]
            )
            if result[0] == "ok":
                return result[1]
            raise UpstreamMalformed(result[1], kind=result[2])
        if "gate" in _WHATIF:
            if not gates:
                gates.append(trio.CapacityLimiter(1))
            async with gates[0]:
                await trio.lowlevel.checkpoint()
                return call()
        if "inline" in _WHATIF:
            return call()
        return await trio.to_thread.run_sync(call, limiter=self.cpu_limiter)

    context.ServerContext.offload = offload  # type: ignore[method-assign]

    if "notext" in _WHATIF:

        def structs(vocab_size: int) -> Any:
            logprob = Annotated[float, msgspec.Meta(le=validation.LOGPROB_EPSILON)]
            token_id = Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]
            entry = msgspec.defstruct(
                "Entry", [("logprob", logprob), ("token_id", token_id)], array_like=True, gc=False
            )
            meta = msgspec.defstruct(
                "MetaInfo",
                [
                    ("output_token_logprobs", list[entry]),  # type: ignore[valid-type]
                    ("completion_tokens", int),
                    ("prompt_tokens", int | None, None),
                    ("cached_tokens", int | None, None),
                    ("finish_reason", validation._FinishReason | None, None),
                    ("weight_version", str | None, None),
                    ("routed_experts", str | None, None),
                ],
            )
            choice = msgspec.defstruct(
                "Choice",
                [
                    ("message", validation._Message),
                    ("finish_reason", str | None, None),
                    ("meta_info", meta | None, None),
                ],
            )
            return msgspec.defstruct(
                "Answer",
                [
                    ("choices", Annotated[list[choice], msgspec.Meta(min_length=1)]),  # type: ignore[valid-type]
                    ("meta_info", meta | None, None),
                    ("model", str | None, None),
                ],
            )

        validation._structs = structs
        validation.answer_decoder.cache_clear()

    if "freeze" in _WHATIF:
        load_model = app._load_model

        async def load_and_freeze(ctx: Any) -> None:
            await load_model(ctx)
            gc.collect()
            gc.freeze()
            sys.stderr.write(f"gc.freeze(): {gc.get_freeze_count()} objects\n")

        app._load_model = load_and_freeze


if _WHATIF and "serve" in sys.argv[1:]:
    _patch()
