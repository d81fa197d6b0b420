"""The `sglang-generate` engine: SGLang's native ``/generate`` with the prompt
ids, sampling parameters translated as SGLang's chat route translates them,
answers parsed by SGLang's own parsers on the worker (docs/engines.md).

Owns: the translation (`request`), the answer check (`answer`), the parser
facts (`parsers`), the agent's chat completion (`reply`), delta-sync's
worker sessions (`delta`), its route's probe (`workers`), the engine
(`engine`) and what the registry knows of it (`spec`). May import what the
engines wing shares (`base`, `answer`, `stitch`, `chat_reply`, `scoring`,
`sglang_workers`, `kv_sessions`, `pool`, `spec`, `served_model`), `prompt`,
`errors` and `tokens`; never another engine package. This ``__init__``
imports nothing: validation processes import `answer` alone.
"""
