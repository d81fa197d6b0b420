"""Parts of the chat completion the token-route engines (``sglang-generate``,
``vllm``) write for the agent alike."""

from __future__ import annotations

from typing import Any

from ..tokens import LogprobArray

__all__ = ["sampled_logprobs"]


def sampled_logprobs(logprobs: LogprobArray, token_texts: list[str | None]) -> dict[str, Any]:
    """``choices[0].logprobs`` of the sampled tokens: each token's text as the
    worker decoded it, its logprob, the text's UTF-8 bytes, no alternatives."""
    content = []
    for logprob, text in zip(logprobs.tolist(), token_texts, strict=True):
        token = text or ""
        content.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [],
            }
        )
    return {"content": content}
