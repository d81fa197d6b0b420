"""Every answer of the emulator's completion routes that is not a clean completion.

Owns SGLang's flat error bodies (bad requests, too-long prompts), the fault
names, which request gets a fault (the ``X-Emulator-Fault`` header, or the
configured fault at a seeded rate), the broken answer each fault produces
(in SGLang's shapes, and in vLLM's for its generate route), and the ASGI
middleware that cuts a response mid-body and drops the
connection, or sends a body that never ends.

Broken bodies are built by serialising the real response with orjson and then
editing bytes, because orjson (correctly) refuses to emit ``NaN``/``Infinity``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import orjson
import trio

if TYPE_CHECKING:  # annotations only: `emulator --help` loads no server stack
    from hypercorn.typing import (
        ASGIFramework,
        ASGIReceiveCallable,
        ASGISendCallable,
        ASGISendEvent,
        Scope,
    )

__all__ = [
    "DROP_AFTER_HEADER",
    "EARLY_FAULTS",
    "ENDLESS_HEADER",
    "FAULTS",
    "FAULT_HEADER",
    "BadRequest",
    "BodyFaultMiddleware",
    "FaultPicker",
    "Reply",
    "context_length_message",
    "early_fault_reply",
    "error_body",
    "fault_reply",
    "faulty_body",
    "vllm_early_fault_reply",
    "vllm_fault_reply",
]

FAULT_HEADER: Final = "X-Emulator-Fault"
# Internal markers from the chat handler to the middleware; never sent to clients.
DROP_AFTER_HEADER: Final = "x-emulator-drop-after"
ENDLESS_HEADER: Final = "x-emulator-endless"
# What follows an endless answer's start: JSON whitespace, one object sent
# again and again (the emulator allocates nothing per chunk).
_FILLER: Final = b" " * (1 << 20)

FAULTS: Final = (
    "http_500",  # 500 with a flat error body
    "http_400",  # 400 with a flat SGLang error body
    "malformed_json",  # 200, body cut in half
    "nan_logprob",  # literal NaN as a logprob
    "infinity_logprob",  # literal Infinity as a logprob
    "positive_logprob",  # logprob 0.5
    "bool_token_id",  # true as a token id
    "str_token_id",  # "123" as a token id
    "float_token_id",  # 5.0 as a token id
    "out_of_vocab_id",  # token id == vocabulary size
    "length_mismatch",  # completion_tokens one more than the entries
    "missing_meta_info",  # choices[0] without meta_info
    "prompt_tokens_mismatch",  # prompt_tokens one more than sent
    "stall",  # never answers
    "drop_connection",  # 200 with Content-Length, half the body, then the connection drops
    "abort",  # a valid 200 whose request was aborted mid-decode (finish_reason abort)
    "endless_body",  # 200, chunked, the answer's start, then whitespace without end
)
# Faults that answer without generating anything.
EARLY_FAULTS: Final = frozenset({"http_500", "http_400", "stall"})

_PLACEHOLDER: Final = "__emulator_fault_placeholder__"


@dataclass(frozen=True)
class Reply:
    """An answer of the emulator: status, body bytes (JSON unless
    ``content_type`` says otherwise), extra headers."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


class BadRequest(Exception):
    """A request SGLang refuses with a flat 400 error; the message is the error's."""

    def reply(self) -> Reply:
        return Reply(400, error_body(str(self)))


def error_body(message: str, *, code: int = 400, type_: str = "BadRequestError") -> bytes:
    """SGLang's flat error object (not OpenAI's nested ``{"error": {...}}``)."""
    return orjson.dumps(
        {"object": "error", "message": message, "type": type_, "param": None, "code": code}
    )


def context_length_message(context_length: int, prompt_tokens: int, budget: int) -> str:
    """SGLang's 400 message for prompt + max tokens over the context length."""
    return (
        "Requested token count exceeds the model's maximum context length of "
        f"{context_length} tokens. You requested a total of {prompt_tokens + budget} tokens: "
        f"{prompt_tokens} tokens from the input messages and {budget} tokens for the "
        "completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit."
    )


class FaultPicker:
    """Chooses the fault of each request: the header wins, else the configured
    fault, for the requests `only` selects (tests: a fault a request's content
    causes, such as one agent's hostile requests; None selects all)."""

    def __init__(
        self,
        fault: str | None,
        rate: float,
        seed: int,
        only: Callable[[Any], bool] | None = None,
    ) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
        self.fault = fault
        self.rate = rate
        self.only = only
        # Own RNG: the fault sequence depends only on the seed and request order.
        self._rng = random.Random(seed)

    def pick(self, requested: str | None, body: Any = None) -> str | None:
        """The fault of a request with parsed `body`; raises ValueError for
        an unknown fault name in the header."""
        if requested:
            if requested not in FAULTS:
                raise ValueError(f"unknown fault {requested!r}; known: {', '.join(FAULTS)}")
            return requested
        if self.fault is None or (self.only is not None and not self.only(body)):
            return None
        if self._rng.random() >= self.rate:
            return None
        return self.fault


def _first_entry(response: dict[str, Any]) -> list[Any]:
    entry: list[Any] = response["choices"][0]["meta_info"]["output_token_logprobs"][0]
    return entry


def _set_logprob(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(response: dict[str, Any]) -> None:
        _first_entry(response)[0] = value

    return edit


def _set_token(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(response: dict[str, Any]) -> None:
        _first_entry(response)[1] = value

    return edit


def _bump(key: str) -> Callable[[dict[str, Any]], None]:
    def edit(response: dict[str, Any]) -> None:
        response["choices"][0]["meta_info"][key] += 1
        response["usage"][key] += 1
        response["usage"]["total_tokens"] += 1

    return edit


def _drop_meta_info(response: dict[str, Any]) -> None:
    del response["choices"][0]["meta_info"]


# (edit of the response dict, bytes that replace the placeholder string)
def _abort(response: dict[str, Any]) -> None:
    # SGLang answers an aborted request with what it decoded so far.
    choice = response["choices"][0]
    meta = choice["meta_info"]
    meta["output_token_logprobs"].pop()
    meta["completion_tokens"] -= 1
    meta["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue"}
    choice["finish_reason"] = "abort"
    choice.pop("matched_stop", None)
    response["usage"]["completion_tokens"] -= 1
    response["usage"]["total_tokens"] -= 1


_EDITS: Final[dict[str, tuple[Callable[[dict[str, Any]], None], bytes | None]]] = {
    "nan_logprob": (_set_logprob(_PLACEHOLDER), b"NaN"),
    "infinity_logprob": (_set_logprob(_PLACEHOLDER), b"Infinity"),
    "positive_logprob": (_set_logprob(0.5), None),
    "bool_token_id": (_set_token(True), None),
    "str_token_id": (_set_token("123"), None),
    "float_token_id": (_set_token(5.0), None),
    "length_mismatch": (_bump("completion_tokens"), None),
    "prompt_tokens_mismatch": (_bump("prompt_tokens"), None),
    "missing_meta_info": (_drop_meta_info, None),
    "abort": (_abort, None),
}


# Body faults that do not touch meta_info.
_PLAIN_FAULTS: Final = frozenset({"malformed_json", "drop_connection", "endless_body"})


def _serialise(fault: str, response: dict[str, Any], literal: bytes | None) -> bytes:
    """The (edited) response's bytes, ``literal`` replacing the placeholder,
    then the framing faults' cut."""
    body = orjson.dumps(response)
    if literal is not None:
        body = body.replace(f'"{_PLACEHOLDER}"'.encode(), literal)
    if fault == "malformed_json":
        return body[: len(body) // 2]
    if fault == "endless_body":
        return body[:-1] + b","  # the object stays open; whitespace follows
    return body


def faulty_body(fault: str, response: dict[str, Any], vocab_size: int) -> bytes:
    """Serialise a successful response with a body-level fault applied (mutates it)."""
    if "meta_info" not in response["choices"][0] and fault not in _PLAIN_FAULTS:
        # Every fault but these edits meta_info, which the request did not ask
        # for (SGLang omits it): there is nothing to break.
        return orjson.dumps(response)
    literal: bytes | None = None
    if fault == "out_of_vocab_id":
        _set_token(vocab_size)(response)
    elif fault in _EDITS:
        edit, literal = _EDITS[fault]
        edit(response)
    return _serialise(fault, response, literal)


async def early_fault_reply(fault: str) -> Reply:
    """The answer of a fault in `EARLY_FAULTS` (``stall`` never returns)."""
    if fault == "stall":
        await trio.sleep_forever()
    if fault == "http_500":
        message = "Internal server error (injected by the emulator)"
        return Reply(500, error_body(message, code=500, type_="InternalServerError"))
    return BadRequest("Bad request (injected by the emulator)").reply()


def _framed(fault: str, body: bytes) -> Reply:
    """A 200 whose framing the middleware breaks for drop_connection / endless_body."""
    if fault == "drop_connection":
        return Reply(200, body, {DROP_AFTER_HEADER: str(len(body) // 2)})
    if fault == "endless_body":
        return Reply(200, body, {ENDLESS_HEADER: "1"})
    return Reply(200, body)


def fault_reply(fault: str, response: dict[str, Any], vocab_size: int) -> Reply:
    """The answer of a body-level fault, built from the real response (mutates it)."""
    return _framed(fault, faulty_body(fault, response, vocab_size))


# -- vLLM's /inference/v1/generate answers -------------------------------------
#
# The same faults in vLLM's shapes (`vllm.answer`): a logprob fault edits
# choices[0].logprobs.content[0].logprob, a token fault choices[0].token_ids[0],
# the count faults `usage`, missing_meta_info drops the logprobs ("logprobs":
# null); `abort` and `stall` are served by the emulator itself (a request
# aborted mid-decode, one that never ends unless /inference/v1/abort_requests
# aborts it).


def _vllm_logprob(value: Any) -> Callable[[dict[str, Any]], bool]:
    def edit(response: dict[str, Any]) -> bool:
        logprobs = response["choices"][0]["logprobs"]
        if not (logprobs and logprobs.get("content")):
            return False  # the request asked for no logprobs: nothing to break
        logprobs["content"][0]["logprob"] = value
        return True

    return edit


def _vllm_token(value: Any) -> Callable[[dict[str, Any]], bool]:
    def edit(response: dict[str, Any]) -> bool:
        ids = response["choices"][0]["token_ids"]
        if not ids:
            return False  # hidden (include_reasoning false) or empty
        ids[0] = value
        return True

    return edit


def _vllm_bump(key: str) -> Callable[[dict[str, Any]], bool]:
    def edit(response: dict[str, Any]) -> bool:
        response["usage"][key] += 1
        response["usage"]["total_tokens"] += 1
        return True

    return edit


def _vllm_drop_logprobs(response: dict[str, Any]) -> bool:
    response["choices"][0]["logprobs"] = None
    return True


_VLLM_EDITS: Final[dict[str, tuple[Callable[[dict[str, Any]], bool], bytes | None]]] = {
    "nan_logprob": (_vllm_logprob(_PLACEHOLDER), b"NaN"),
    "infinity_logprob": (_vllm_logprob(_PLACEHOLDER), b"Infinity"),
    "positive_logprob": (_vllm_logprob(0.5), None),
    "bool_token_id": (_vllm_token(True), None),
    "str_token_id": (_vllm_token("123"), None),
    "float_token_id": (_vllm_token(5.0), None),
    "length_mismatch": (_vllm_bump("completion_tokens"), None),
    "prompt_tokens_mismatch": (_vllm_bump("prompt_tokens"), None),
    "missing_meta_info": (_vllm_drop_logprobs, None),
}


def vllm_early_fault_reply(fault: str) -> Reply:
    """``http_500`` / ``http_400`` in vLLM's error shape (``ErrorResponse``)."""
    if fault == "http_500":
        message, type_, code = (
            "Internal server error (injected by the emulator)",
            "InternalServerError",
            500,
        )
    else:
        message, type_, code = "Bad request (injected by the emulator)", "BadRequestError", 400
    error = {"message": message, "type": type_, "param": None, "code": code}
    return Reply(code, orjson.dumps({"error": error}))


def vllm_fault_reply(fault: str, response: dict[str, Any], vocab_size: int) -> Reply:
    """A body-level fault on a vLLM generate answer (mutates it); a fault
    with nothing to break in this answer leaves it whole."""
    literal: bytes | None = None
    if fault == "out_of_vocab_id":
        _vllm_token(vocab_size)(response)
    elif fault in _VLLM_EDITS:
        edit, literal = _VLLM_EDITS[fault]
        if not edit(response):
            literal = None
    return _framed(fault, _serialise(fault, response, literal))


class _ConnectionDropped(Exception):
    """Unwinds the app once the partial body is out, so nothing completes the response."""


class BodyFaultMiddleware:
    """ASGI wrapper for the faults that break a response's framing.

    A response carrying ``DROP_AFTER_HEADER: n`` sends its status, headers
    (Content-Length of the full body) and the first ``n`` body bytes, then
    aborts. The server then closes the connection with the body incomplete,
    which an HTTP client sees as a protocol/read error.

    A response carrying ``ENDLESS_HEADER`` is sent without a Content-Length
    (so chunked), its body followed by whitespace without end, until the
    client goes away (the app is then cancelled, as for any disconnect).
    """

    def __init__(
        self, app: ASGIFramework, on_endless_end: Callable[[], None] | None = None
    ) -> None:
        self._app = app
        # Called once an endless body stops (its client went away).
        self._on_endless_end = on_endless_end

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        drop_after: int | None = None
        endless = False

        async def guarded_send(message: ASGISendEvent) -> None:
            nonlocal drop_after, endless
            if message["type"] == "http.response.start":
                raw = list(message["headers"])
                endless = any(name.lower() == ENDLESS_HEADER.encode() for name, _ in raw)
                headers = []
                for name, value in raw:
                    lowered = name.lower()
                    if lowered == DROP_AFTER_HEADER.encode():
                        drop_after = int(value)
                    elif lowered != ENDLESS_HEADER.encode() and not (
                        endless and lowered == b"content-length"
                    ):
                        headers.append((name, value))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and drop_after is not None:
                body = bytes(message.get("body", b""))[:drop_after]
                await send({"type": "http.response.body", "body": body, "more_body": True})
                raise _ConnectionDropped
            elif message["type"] == "http.response.body" and endless:
                body = bytes(message.get("body", b""))
                try:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    while True:
                        await send(
                            {"type": "http.response.body", "body": _FILLER, "more_body": True}
                        )
                finally:
                    if self._on_endless_end is not None:
                        self._on_endless_end()
            await send(message)

        try:
            await self._app(scope, receive, guarded_send)
        except* _ConnectionDropped:
            # Returning with the body incomplete makes hypercorn close the connection.
            pass
