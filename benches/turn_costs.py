"""Where a large turn's CPU goes: the server's per-step cost, in-process.

Complements P1 (``large_turns.py``), whose numbers on a shared 2-core machine
move with whatever else runs: this measures CPU time of each step of the
server's turn path on the P1 shape, single-threaded, median of ``--repeats``.
A real emulator process (``--completion-tokens`` 30k) answers two turns of
one session, each run by the server's own `TurnRunner` in this process (the
``sglang-chat`` engine with a worker pool of the emulator,
benches/_turns.py); then each step of the second turn is timed again on its
own, with the inputs the runner used:

- ``parse_chat_request`` of the agent's body (it carries the 30k-token answer
  back as history) and ``plan_turn`` (token-in/token-out append), both on the
  session as it was before the turn; ``upstream_body``: `chat_body` of the
  `EngineRequest` the runner handed the engine;
- ``parse_worker_answer`` (strict msgspec validation + id/logprob extraction)
  next to ``orjson.loads`` alone, and what-if decoders: entries without the
  ``text`` field, entries as tuples; and the same on an SGLang-like answer
  whose entries carry the token text (as real SGLang sends, ~1 MiB);
- ``commit_turn`` of the turn's plan and what the runner made of the
  engine's completion (`turn.runner.sampled`): the runner's commit is undone
  and the turn committed again, each repeat undone outside the timing (so
  the truncation earlier versions timed with it is not counted: a few µs);
  the export of the 60k-token session (``export_document`` + ``serialize``,
  what DELETE does).

    python benches/turn_costs.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson
import trio
from _common import (
    bench_parser,
    child,
    emulator_command,
    load_average,
    table,
    tokenizer_path,
    write_json,
)
from _turns import Recorder, emulator_runner

from rollout_session.engines.answer import LOGPROB_EPSILON
from rollout_session.engines.sglang_chat.answer import answer_decoder, parse_worker_answer
from rollout_session.engines.sglang_chat.engine import chat_body
from rollout_session.export.document import export_document, serialize
from rollout_session.prompt.tokenizer import load_tokenizer
from rollout_session.session.commit import CommitUndo, commit_turn
from rollout_session.turn.plan import plan_turn
from rollout_session.turn.request import parse_chat_request
from rollout_session.turn.runner import sampled


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def what_if_decoders(vocab: int) -> dict[str, msgspec.json.Decoder[Any]]:
    """Decoders as strict as the server's, for the entries only."""
    logprob = Annotated[float, msgspec.Meta(le=LOGPROB_EPSILON)]
    token_id = Annotated[int, msgspec.Meta(ge=0, lt=vocab)]
    no_text = msgspec.defstruct(
        "Entry", [("logprob", logprob), ("token_id", token_id)], array_like=True, gc=False
    )
    out = {}
    for name, entry in (
        ("entries without text field", no_text),
        ("entries as tuples", tuple[logprob, token_id, str | None]),
    ):
        meta = msgspec.defstruct(
            "Meta", [("output_token_logprobs", list[entry]), ("completion_tokens", int)]
        )
        choice = msgspec.defstruct("Choice", [("meta_info", meta)])
        out[name] = msgspec.json.Decoder(msgspec.defstruct("Answer", [("choices", list[choice])]))
    return out


def extract(entries: list[Any]) -> tuple[Any, Any]:
    if entries and isinstance(entries[0], tuple):
        return (
            np.array([e[1] for e in entries], np.int32),
            np.array([e[0] for e in entries], np.float32),
        )
    return (
        np.array([e.token_id for e in entries], np.int32),
        np.array([e.logprob for e in entries], np.float32),
    )


def with_text(answer: bytes, tokenizer: Any) -> bytes:
    """The same answer with each entry's token text filled in, as SGLang sends it."""
    data = orjson.loads(answer)
    meta = data["choices"][0]["meta_info"]
    for entry in meta["output_token_logprobs"]:
        entry[2] = tokenizer.decode_pieces([entry[1]])[0]
        entry[0] = entry[0] - 1.234567e-7  # full-precision floats, like a real sampler
    return orjson.dumps(data)


async def main(args: argparse.Namespace) -> None:
    print(f"{load_average()}; completion {args.completion_tokens} tokens, {args.repeats} repeats")
    tokenizer = load_tokenizer(tokenizer_path())
    flags = ["--completion-tokens", str(args.completion_tokens), "--context-length", "131072"]
    rows: list[dict[str, Any]] = []

    def row(step: str, value: float, note: str = "") -> None:
        rows.append({"step": step, "ms": value, "note": note})

    async with (
        child("emulator", emulator_command(*flags, "--record-limit", "0")) as emulator,
        emulator_runner(emulator.url, tokenizer) as runner,
    ):
        recorder = runner.engine
        assert isinstance(recorder, Recorder)
        policy = runner.policy
        session = await runner.store.create(None, metadata=None, ttl_s=None)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Write a long essay."}]
        for turn in range(2):
            body = orjson.dumps({"messages": messages, "max_tokens": args.completion_tokens})
            if turn == 1:  # time the second turn's steps before the runner runs it
                request = parse_chat_request(body)
                row("agent body", len(body) / 2**20, "MiB (history incl. the 30k-token answer)")
                row(
                    "parse_chat_request", median_ms(partial(parse_chat_request, body), args.repeats)
                )
                plan_call = partial(plan_turn, session, request, tokenizer, policy)
                row("plan_turn", median_ms(plan_call, args.repeats))
                plan = plan_call()
                # What the session store keeps to undo a commit.
                undo = CommitUndo.before(session, plan)
            outcome = await runner.run(session.id, body)
            if outcome.reply.status != 200:
                raise SystemExit(f"turn {turn}: worker said {outcome.reply.status}")
            sent, completion = recorder.completion()
            answer_body = completion.reply.body
            vocab = sent.vocab_size
            if turn == 1:
                assert np.array_equal(sent.input_ids, plan.input_ids), (
                    "the runner planned otherwise"
                )
                model = runner.model.upstream_name(request.raw.get("model"))
                row(
                    "upstream_body",
                    median_ms(partial(chat_body, sent, model, session_hint=None), args.repeats),
                )
                # The runner's commit taken back, then the same turn committed
                # again: each repeat is undone outside the timing, the last kept.
                undo.apply(session)
                slot = runner.store.claim(session)
                turn_sampled = sampled(completion)
                times = []
                for repeat in range(args.repeats):
                    if repeat:
                        undo.apply(session)
                    now = time.time()
                    started = time.perf_counter()
                    commit_turn(session, slot, plan, turn_sampled, now)
                    times.append(time.perf_counter() - started)
                session.release(slot, time.time())
                row("commit_turn", 1000 * statistics.median(times), "30k sampled tokens")
            message = orjson.loads(answer_body)["choices"][0]["message"]
            messages = [
                *messages,
                {"role": "assistant", "content": message["content"]},
                {"role": "user", "content": "Continue."},
            ]
    sent_tokens = len(sent.input_ids)

    # Validation of the worker's answer, current and what-if.
    sglang_like = with_text(answer_body, tokenizer)
    decoders = what_if_decoders(vocab)
    current = answer_decoder(vocab)
    for label, raw in (("emulator answer", answer_body), ("SGLang-like answer", sglang_like)):
        entries = current.decode(raw).choices[0].meta_info.output_token_logprobs
        row(f"[{label}] size", len(raw) / 2**20, f"MiB, {len(entries)} entries")
        row(f"[{label}] orjson.loads", median_ms(partial(orjson.loads, raw), args.repeats))
        row(
            f"[{label}] parse_worker_answer",
            median_ms(
                partial(parse_worker_answer, raw, sent_prompt_tokens=sent_tokens, vocab_size=vocab),
                args.repeats,
            ),
            "current: decode + extract",
        )
        row(f"[{label}]   msgspec decode", median_ms(partial(current.decode, raw), args.repeats))
        row(
            f"[{label}]   extract ids/logprobs (np.fromiter x2)",
            median_ms(
                lambda entries=entries: (
                    np.fromiter((e.token_id for e in entries), np.int32, len(entries)),
                    np.fromiter((e.logprob for e in entries), np.float32, len(entries)),
                ),
                args.repeats,
            ),
        )
        for name, decoder in decoders.items():

            def decode_and_extract(decoder: Any = decoder, raw: bytes = raw) -> Any:
                decoded = decoder.decode(raw).choices[0].meta_info.output_token_logprobs
                return extract(decoded)

            row(
                f"[{label}] what-if: {name}",
                median_ms(decode_and_extract, args.repeats),
                "decode + extract",
            )

    document = export_document(session, "closed")
    row(
        "export_document (60k tokens)",
        median_ms(partial(export_document, session, "closed"), args.repeats),
    )
    row("serialize export", median_ms(partial(serialize, document), args.repeats))
    print()
    print(load_average())
    print(table(rows))
    write_json(args.json, {"load": load_average(), "rows": rows})


if __name__ == "__main__":
    parser = bench_parser(__doc__)
    parser.add_argument("--completion-tokens", type=int, default=30000)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", type=Path)
    trio.run(main, parser.parse_args())
