"""SGLang's ``/v1/chat/completions`` with ``input_ids``: the `sglang-chat` engine.

Owns: the worker's request and the engine (`engine`), the strict check of
the chat route's answer (`answer`: pure, picklable), its route's probe
(`workers`) and what the registry knows of it (`spec`). May import what the
engines wing shares (`base`, `answer`, `stitch`, `sglang_workers`,
`kv_sessions`, `pool`, `spec`, `served_model`), `errors` and `tokens`;
never another engine package. This ``__init__`` imports nothing:
validation processes import `answer` alone.
"""
