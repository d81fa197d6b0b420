"""A turn's token limits: the model's context and ``--max-session-tokens``.

Two checks, both pure. `check_prompt_floor` runs before any render: a lower
bound on the prompt's tokens from the messages' text, so an oversize body is
refused in the time it takes to parse it, not to render and tokenise it.
`completion_budget` runs on the planned prompt: it refuses what cannot fit
and returns the ``max_tokens`` the worker must be sent so that the session
cap is hard.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ContextLengthExceeded
from ..prompt.messages import Message

__all__ = ["FLOOR_ROLES", "check_prompt_floor", "completion_budget"]

# Roles whose content every template renders, whole: assistant content may be
# cut (Qwen3 drops a past answer's <think> part), system content moved or
# merged. Counted after strip(): templates may trim surrounding whitespace.
FLOOR_ROLES = frozenset({"user", "tool"})


def prompt_floor(messages: Iterable[Message], max_token_bytes: int) -> int:
    """Fewer tokens than this cannot hold `messages`' user and tool text.

    No token covers more than `max_token_bytes` bytes of text (the longest
    token in the vocabulary, measured in UTF-8, which over-counts byte-level
    and SentencePiece tokens alike); the factor 2 leaves room for a
    tokenizer's normaliser shortening text (NFKC ligatures).
    """
    text = sum(
        len(m["content"].strip().encode("utf-8"))
        for m in messages
        if m["role"] in FLOOR_ROLES and isinstance(m.get("content"), str)
    )
    return text // (2 * max_token_bytes)


def _limits(context_length: int | None, session_cap: int | None) -> list[tuple[int, str]]:
    named = (
        (context_length, "the model's context"),
        (session_cap, "the session token cap (--max-session-tokens)"),
    )
    return [(limit, what) for limit, what in named if limit is not None]


def check_prompt_floor(
    messages: Iterable[Message],
    max_tokens: int | None,
    *,
    max_token_bytes: int,
    context_length: int | None,
    session_cap: int | None,
    body_bytes: int,
) -> None:
    """Refuse, before rendering, messages that cannot fit a limit.

    `body_bytes`, the size of the JSON body that carried `messages`, bounds
    their text from above: a body too small to be refused is not measured
    (measuring is O(history), every turn).
    """
    limits = _limits(context_length, session_cap)
    smallest = min((limit for limit, _ in limits), default=None)
    if smallest is None or body_bytes // (2 * max_token_bytes) + (max_tokens or 1) <= smallest:
        return
    floor = prompt_floor(messages, max_token_bytes)
    for limit, what in limits:
        if floor + (max_tokens or 1) > limit:
            raise ContextLengthExceeded(
                f"the messages hold at least {floor} tokens of user and tool text; with "
                f"max_tokens {max_tokens or 1} that exceeds {what} of {limit} tokens",
                param="messages",
            )


def completion_budget(
    prompt_tokens: int,
    max_tokens: int | None,
    *,
    context_length: int | None,
    session_cap: int | None,
) -> int | None:
    """The ``max_tokens`` to send the worker (None: the agent's, unchanged).

    A prompt that leaves no room for one token, or an explicit `max_tokens`
    over a limit, is refused (like an OpenAI server's context error). Without
    `max_tokens` the worker may sample to its context's end, so under a
    session cap the request gets what the cap leaves.
    """
    for limit, what in _limits(context_length, session_cap):
        if prompt_tokens + (max_tokens or 1) > limit:
            raise ContextLengthExceeded(
                f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens or 1} "
                f"exceeds {what} of {limit} tokens",
                param="messages",
            )
    if max_tokens is None and session_cap is not None:
        # Not past the context either: a cap above it must not ask for more
        # than the worker can give (SGLang refuses such a request).
        room = session_cap if context_length is None else min(session_cap, context_length)
        return room - prompt_tokens
    return None
