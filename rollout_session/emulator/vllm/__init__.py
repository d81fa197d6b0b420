"""What the emulator knows of vLLM 0.33.0's token routes.

Owns: the ``/inference/v1/generate`` request's checks (`generate`) and
answer (`answer`), ``/v1/chat/completions/render`` (`render`) and
``/derender`` (`derender`), vLLM's parser and constant names (`names`) and
the structural tag a tool-call constraint becomes (`tag`). Each module
names the vLLM source it models. May import the emulator's `model`,
`faults` and the server's `prompt`, `errors` and `tokens`; never the
server's other wings.
"""
