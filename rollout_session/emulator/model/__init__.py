"""The emulator's language model: what it samples and how sure it is.

Owns: one completion for a prompt (`generation`: the tool-call choice,
deterministic words, the template's own rendering of the answer as ids),
what the model reads from its prompt ids (`prompt_reader`), the
log-probability function shared by sampling and scoring (`logprobs`),
where a prompt that continues the model's own answer splits
(`continuation`), the tool call a grammar forces (`forced_call`) and the
experts a position routes to (`routed_experts`). Engine-neutral: both the
SGLang and the vLLM routes sample here, so the same ids and sampling
parameters give the same completion on every route. May import the
server's `prompt`, `errors` and `tokens`; nothing of the emulator's
routes (`sglang/`, `vllm/`) or of its core.
"""
