"""What the emulator knows of vLLM 0.33.0: its routes over the engine-neutral core.

Owns: the vLLM half of a server (`worker`: render, derender and abort
handling, the detokenizer); the request bodies as vLLM's pydantic models
(`token_protocol`: ``GenerateRequest``, ``ParseContext``, the derender
union; `chat_protocol`: ``ChatCompletionRequest`` and its "before"
validators; `sampling`: ``SamplingParams`` and its ``__post_init__``) and
vLLM's error answers (`errors`); ``/inference/v1/generate`` (the checks
past pydantic: `generate`; serving: `serve_tokens`; the answer: `answer`),
``/v1/chat/completions/render`` (`render`: the template in `hf_renderer`,
the parsers' ``adjust_request`` in `adjust_request`, ``reasoning_ended``
in `reasoning_end`) and ``/derender`` (`derender`), vLLM's parser and
constant names (`names`), the server's sampling defaults
(`generation_config`: ``--generation-config``,
``--override-generation-config``), the structural tag a tool-call constraint
becomes (`tag`), the RL routes (`weight_routes`) and the Quart routes
(`routes`). Each module names the vLLM source it models.

May import: the emulator's engine-neutral modules (`worker`, `records`,
`faults`, `weights`, `gpu`, `prefix_cache`, `config`, `model`) and, of
the server, only `prompt`, `errors`, `tokens`, `_lazy` and `http.serving`.
Never `sglang/`: what both engines share lives in an engine-neutral module.
"""
