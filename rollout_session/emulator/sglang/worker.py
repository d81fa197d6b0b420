"""The SGLang half of an emulator server: what its chat and ``/generate``
routes share beyond the engine-neutral `Emulator`.

Owns `SglangWorker`: the launch flags both routes read (the parsers, as
the chat route runs them: a deprecated tool-call parser name resolved,
`names`; ``--skip-tokenizer-init``; ``--preferred-sampling-params``), the
detokenizer's text of an answer, the answer's ``reasoning_tokens``, the
memo the parse routes answer from (`parse_memo`; every sample SGLang's
routes draw is noted), how an answer settles once its run ended (an
abort's cut, the weight-version spans and each token's logprob under the
version that sampled it: ``weights``), the routed-experts blob
(``--enable-return-routed-experts``) and ``/parse_function_call`` and
``/separate_reasoning`` (which parse text: ``--skip-tokenizer-init``
changes nothing there, as their detectors need no tokenizer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

from rollout_session.emulator.faults import BadRequest, Reply
from rollout_session.emulator.model.forced_call import ToolConstraint
from rollout_session.emulator.model.generation import Sample
from rollout_session.emulator.sglang.answer import routed_experts_blob
from rollout_session.emulator.sglang.io_struct import lax_true
from rollout_session.emulator.sglang.names import resolved_tool_call_parser
from rollout_session.emulator.sglang.parse_memo import ParseMemo
from rollout_session.emulator.sglang.replies import opt_int
from rollout_session.emulator.weights import ABORTED, WAITING_ABORTED, Run, Span
from rollout_session.emulator.worker import Emulator
from rollout_session.prompt.tokenizer import generation_stop_ids

__all__ = ["SglangWorker", "reported_spans", "text_ids"]

# Prompt ids before a completion that SGLang's detokenizer decodes it after
# (schedule_batch.py INIT_INCREMENTAL_DETOKENIZATION_OFFSET).
_DETOKENIZE_CONTEXT: Final = 5


class SglangWorker:
    """SGLang's routes over one `Emulator`."""

    def __init__(self, emulator: Emulator) -> None:
        self.emulator = emulator
        config = emulator.config
        # The parsers the chat route runs and /server_info and /model_info
        # report: the resolved names (arg_groups/serving_hook.py handle_deprecated_args).
        self.tool_call_parser = resolved_tool_call_parser(config.tool_call_parser)
        self.reasoning_parser = config.reasoning_parser
        # --skip-tokenizer-init: the tokenizer manager, scheduler and
        # detokenizer load no tokenizer (tokenizer_manager.py
        # init_tokenizer_and_processor, scheduler.py init_tokenizer).
        self.has_tokenizer = not config.skip_tokenizer_init
        if not self.has_tokenizer and generation_stop_ids(config.tokenizer_path) is None:
            # Without a tokenizer the scheduler stops on the model config's EOS
            # ids alone (configs/model_config.py _get_hf_eos_token_id); the
            # emulator's model would stop on the tokenizer's.
            raise ValueError(
                "the emulator does not model --skip-tokenizer-init for a model directory "
                "without generation_config.json eos_token_id"
            )
        # --preferred-sampling-params: under every request's own
        # (TokenizerManager._create_tokenized_object).
        self.preferred: Mapping[str, Any] = config.preferred_sampling_params or {}
        # What the parse routes answer: every sample's texts → its parsed message.
        self.parsed = ParseMemo(emulator.decode)

    def sampling_params(self, requested: Mapping[str, Any]) -> dict[str, Any]:
        """The sampling parameters a request runs with:
        ``{**preferred_sampling_params, **sampling_params}``."""
        return {**self.preferred, **requested}

    def reasoning_tokens(self, sample: Sample) -> int:
        """``meta_info.reasoning_tokens``: counted by the scheduler only with the
        reasoning parser's think-end ids, which it encodes with its tokenizer
        (scheduler.py ``init_tokenizer``; ``_maybe_update_reasoning_tokens``
        returns without them): 0 without ``--reasoning-parser`` or with
        ``--skip-tokenizer-init``, else the sample's count."""
        if self.reasoning_parser is None or not self.has_tokenizer:
            return 0
        return sample.reasoning_tokens

    def detokenize(self, prompt: Sequence[int], ids: Sequence[int], skip: bool) -> str:
        """The detokenizer's text of a completion: decoded after the last
        prompt ids (``Req.init_incremental_detokenize``'s surrounding
        offset; DetokenizerManager keeps what follows their text)."""
        decode = self.emulator.decode
        context = list(prompt[-_DETOKENIZE_CONTEXT:])
        if not context:
            return decode(ids, skip)
        head = decode(context, skip)
        return decode([*context, *ids], skip)[len(head) :]

    def sample(
        self, prompt: list[int], seed: int | None, budget: int, constraint: ToolConstraint
    ) -> Sample:
        """The model's sample (`Emulator.sample`), noted for the parse routes
        (a continuation's whole answer too)."""
        sample = self.emulator.sample(prompt, seed, budget, constraint)
        if sample.whole is not None:
            self.parsed.note(text_ids(sample.whole), sample.whole.message)
        self.parsed.note(text_ids(sample), sample.message)
        return sample

    def settle(self, run: Run, prompt: Sequence[int], sample: Sample) -> tuple[Sample, list[Span]]:
        """What an SGLang request answers once its run ended: the sample, or
        the tokens an abort left of it (`weights`), with the version spans
        and each token's logprob under the policy that sampled it."""
        emulator = self.emulator
        abort = run.abort
        if abort is not None:
            finish = WAITING_ABORTED if abort.waiting else ABORTED
            if sample.ids:
                sample = emulator.speaker.segment(sample, 0, abort.tokens, dict(finish))
                self.parsed.note(text_ids(sample), sample.message)
            else:  # prefill only: nothing sampled to cut
                sample = replace(sample, finish=dict(finish))
            if not abort.waiting:
                # It finished (aborted): its KV stays in the radix cache.
                emulator.cache.insert([*prompt, *sample.ids])
        spans = emulator.weights.spans(run, len(sample.ids))
        return replace(sample, logprobs=emulator.policy(prompt, sample.ids, spans)), spans

    def routed_experts(self, body: dict[str, Any], prompt: list[int], sample: Sample) -> str | None:
        """``meta_info.routed_experts`` if the request asks for it (chat and
        /generate alike); raises BadRequest for a start past the positions
        (checked on the whole sample before it is served: an aborted
        answer's shorter one has none then)."""
        if not lax_true(body.get("return_routed_experts")):
            return None
        start_len = opt_int(body, "routed_experts_start_len", 0) or 0
        forwarded = len(prompt) + len(sample.ids) - 1  # the last sampled token is never forwarded
        if start_len > forwarded:
            if sample.finish.get("type") == "abort":
                return None
            raise BadRequest(f"routed_experts_start_len {start_len} > {forwarded} positions")
        cfg = self.emulator.config
        if not cfg.return_routed_experts:
            return None
        return routed_experts_blob(
            (prompt + sample.ids)[:forwarded],
            start_len,
            layers=cfg.routed_experts_layers,
            top_k=cfg.routed_experts_top_k,
            num_experts=cfg.routed_experts_num_experts,
        )

    # -- /parse_function_call, /separate_reasoning ---------------------------

    def parse_function_call(self, raw: bytes) -> Reply:
        """``/parse_function_call``: the tool calls of a text the emulator sampled."""
        self.emulator.parse_calls["parse_function_call"] += 1
        return self._parse_counted(self.parsed.parse_function_call(raw))

    def separate_reasoning(self, raw: bytes) -> Reply:
        """``/separate_reasoning``: the reasoning of a text the emulator sampled."""
        self.emulator.parse_calls["separate_reasoning"] += 1
        return self._parse_counted(self.parsed.separate_reasoning(raw))

    def _parse_counted(self, reply: Reply) -> Reply:
        if reply.status != 200:
            self.emulator.parse_calls["refused"] += 1
        self.emulator.notify()
        return reply


def reported_spans(spans: Sequence[Span]) -> list[dict[str, Any]] | None:
    """SGLang's ``meta_info.weight_versions`` (and the chat route's
    ``metadata``), reported for an answer that spans a version change.
    SGLang 0.5.23 reports them for every finished answer; the single span
    of an answer sampled under one label says no more than its
    ``weight_version`` (docs/emulator.md#weight-updates)."""
    return [span.json() for span in spans] if len(spans) > 1 else None


def text_ids(sample: Sample) -> list[int]:
    """The ids /generate's ``text`` decodes: through the stop, the matched stop
    token trimmed (``DetokenizerManager.trim_matched_stop``, no_stop_trim off)."""
    finish = sample.finish
    if finish.get("type") == "stop" and isinstance(finish.get("matched"), int):
        return sample.ids[:-1]
    return sample.ids
