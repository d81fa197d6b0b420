"""What the emulator knows of vLLM 0.33.0: its routes over the engine-neutral core.

Owns: the vLLM half of a server (`worker`: render, derender and abort
handling, the detokenizer), ``/inference/v1/generate`` (its request: the
pydantic models of vLLM's request models in `request_models`, the checks
past them and vLLM's error shapes in `generate`; its serving in
`serve_tokens`, its answer in `answer`), ``/v1/chat/completions/render``
(`render`) and ``/derender`` (`derender`), vLLM's parser and constant
names (`names`), the structural tag a tool-call constraint becomes
(`tag`), the RL routes (`weight_routes`) and the Quart routes (`routes`).
Each module names the vLLM source it models.

May import: the emulator's engine-neutral modules (`worker`, `records`,
`faults`, `weights`, `gpu`, `prefix_cache`, `config`, `model`) and, of
the server, only `prompt`, `errors`, `tokens`, `_lazy` and `http.serving`.
Never `sglang/`: what both engines share lives in an engine-neutral module.
"""
