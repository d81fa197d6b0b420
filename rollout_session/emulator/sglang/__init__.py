"""What the emulator knows of SGLang 0.5.23: its routes over the engine-neutral core.

Owns: the SGLang half of a server (`worker`: the launch flags its routes
read, parse memo, how an answer settles, routed experts, the parse routes
``/parse_function_call`` and ``/separate_reasoning`` answered from
`parse_memo`), SGLang's parser names and how its launch resolves them
(`names`) and what its launch checks (`launch`), ``/v1/chat/completions``
(`chat`; its message under the worker's parsers: `chat_message`; its
answer in SGLang's response models: `answer`), ``/generate``
(`generate`; what it checks in a body: FastAPI's parse in `io_struct`, the
contract gate in `contract_gate`, ``SamplingParams`` in `generate_params`),
the session routes (`session_routes`) and the session controller they
drive (`sessions`), the weight-update, pause and abort routes
(`weight_routes`; their bodies read as `io_struct`'s types), SGLang's
error replies (`replies`) and the Quart routes (`routes`). Each module
names the SGLang source it models.

May import: the emulator's engine-neutral modules (`worker`, `records`,
`faults`, `weights`, `gpu`, `prefix_cache`, `config`, `model`) and, of
the server, only `prompt`, `errors`, `tokens`, `_lazy` and `http.serving`.
Never `vllm/`: what both engines share lives in an engine-neutral module.
"""
