"""The vLLM half of an emulator server: its state beyond the engine-neutral
`Emulator` and its routes' handling, independent of HTTP.

Owns `VllmWorker`: what the served vLLM was started with (`VllmServer`),
the chat template ``/v1/chat/completions/render`` renders with, the
token route's answers ``/v1/chat/completions/derender`` parses, the
detokenizer, and the handling of ``/inference/v1/generate``
(`serve_tokens`), ``/render`` (`render`), ``/derender`` (`derender`) and
``/inference/v1/abort_requests`` (``entrypoints/scale_out/
token_in_token_out/api_router.py`` ``abort_requests``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import trio

from rollout_session.emulator.faults import Reply
from rollout_session.emulator.records import ChatRecord
from rollout_session.emulator.vllm import serve_tokens
from rollout_session.emulator.vllm.derender import Detokenizer, SampledAnswers, derender_chat
from rollout_session.emulator.vllm.errors import VllmError
from rollout_session.emulator.vllm.errors import error_body as vllm_error_body
from rollout_session.emulator.vllm.generate import VllmServer
from rollout_session.emulator.vllm.generation_config import generation_defaults
from rollout_session.emulator.vllm.hf_renderer import ChatTemplate
from rollout_session.emulator.vllm.render import render_chat
from rollout_session.emulator.worker import Emulator
from rollout_session.prompt.tokenizer import generation_stop_ids

__all__ = ["VllmWorker"]


class VllmWorker:
    """vLLM's routes over one `Emulator`."""

    def __init__(self, emulator: Emulator) -> None:
        self.emulator = emulator
        config = emulator.config
        model = emulator.model
        defaults = generation_defaults(
            config.tokenizer_path, config.generation_config, config.override_generation_config
        )
        self.server = VllmServer(
            model_name=config.model_name,
            context_length=config.context_length,
            vocab_size=model.vocab_size,
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
            sampling_defaults=defaults.sampling,
            max_tokens_cap=defaults.max_tokens_cap,
        )
        # What /v1/chat/completions/render renders with (vLLM's HF renderer).
        self.chat_template = ChatTemplate(
            model.tokenizer, str(emulator.speaker.template.chat_template)
        )
        # generation_config.json's eos_token_id: stop tokens beyond the tokenizer's EOS.
        self.extra_eos = frozenset(generation_stop_ids(config.tokenizer_path) or ())
        self._token_texts: dict[int, str] = {}
        # What /v1/chat/completions/derender parses: the token route's whole answers.
        self.answers = SampledAnswers(emulator.decode)
        self.detokenizer = Detokenizer(
            decode=emulator.decode,
            token_text=self.token_text,
            eos_token_id=model.tokenizer.eos_token_id,
            generation_eos_ids=self.extra_eos,
            vocab_size=model.vocab_size,
        )

    def token_text(self, token: int) -> str:
        """One token's text in a logprob entry (``tokenizer.decode([id])``), memoised."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = str(self.emulator.model.tokenizer.decode([token]))
        return text

    def decoded_pieces(self, ids: Sequence[int]) -> list[str]:
        """``tokenizer.decode([id])`` of each id (``convert_ids_list_to_tokens``)."""
        return [str(p) for p in self.emulator.model.tokenizer.batch_decode([[t] for t in ids])]

    async def generate(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        """One ``/inference/v1/generate`` call (``headers`` lowercased),
        counted as completed or cancelled."""
        return await self.emulator.counted(serve_tokens.serve(self, raw, headers))

    async def render(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        """One ``/v1/chat/completions/render`` call (``headers`` lowercased),
        counted as completed or cancelled: the ``GenerateRequest`` vLLM's
        chat route would sample (`render`). Recorded with route
        "vllm-render"; no GPU time, no fault."""
        return await self.emulator.counted(self._render(raw, headers))

    async def _render(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        self._record(raw, headers, "vllm-render")
        try:
            answer = render_chat(
                raw,
                headers.get("content-type", ""),
                headers.get("x-request-id"),
                self.server,
                self.chat_template,
            )
        except VllmError as exc:
            return exc.reply()
        return Reply(200, orjson.dumps(answer))

    async def derender(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        """One ``/v1/chat/completions/derender`` call (``headers``
        lowercased), counted: the chat completion vLLM's parsers make of a
        token-route answer (`derender`). Recorded with route
        "vllm-derender"; no GPU time, no fault."""
        return await self.emulator.counted(self._derender(raw, headers))

    async def _derender(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        self._record(raw, headers, "vllm-derender")
        return derender_chat(
            raw, headers.get("content-type", ""), self.server, self.detokenizer, self.answers
        )

    def _record(self, raw: bytes, headers: Mapping[str, str], route: str) -> None:
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        session = headers.get("x-session-id")
        self.emulator.record(
            ChatRecord(body, trio.current_time(), None, session, route, len(raw), headers)
        )

    def abort_requests(self, raw: bytes) -> Reply:
        """``/inference/v1/abort_requests {request_ids}`` (``api_router.py``
        ``abort_requests``): 200 with an empty body; every running request
        whose engine id (``generate-tokens-<id>``) is listed ends with
        finish_reason "abort" and the tokens it had so far."""
        try:
            body: Any = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            message = f"JSON decode error: {exc}"
            return Reply(400, vllm_error_body(message, "Bad Request", 400))
        if not isinstance(body, dict):  # `body.get` fails: the app's 500
            message = f"'{type(body).__name__}' object has no attribute 'get'"
            return Reply(500, vllm_error_body(message, "InternalServerError", 500))
        ids = body.get("request_ids")
        if ids is None:
            message = "Missing 'request_ids' in request body"
            return Reply(400, vllm_error_body(message, "Bad Request", 400))
        wanted = [ids] if isinstance(ids, str) else [i for i in ids if isinstance(i, str)]
        self.emulator.abort_requests.extend(wanted)
        self.emulator.weights.abort_keys(wanted, "inference/v1/abort_requests")
        return Reply(200, b"")
