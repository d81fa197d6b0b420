"""The ``vllm`` engine: vLLM's token-in/token-out ``/inference/v1/generate``
with ``output_mode: "derender"`` (vLLM samples and parses with its own
parsers in one call).

Owns: the chat route's translation (`request`), the workers' parser facts
(`parsers`), the answer's strict check (`answer`), the agent's reply
(`reply`), how the pool speaks to vLLM workers (`worker`), the engine
(`engine`) and what the registry knows of it (`spec`). May import what the
engines wing shares (`base`, `answer`, `stitch`, `chat_reply`, `scoring`,
`kv_sessions`, `pool`, `spec`, `served_model`), `prompt`, `errors` and
`tokens`; never another engine package. This ``__init__`` imports nothing:
validation processes import `answer` alone.
"""
