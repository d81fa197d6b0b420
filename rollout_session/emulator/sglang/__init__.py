"""What the emulator knows of SGLang 0.5.23's routes beyond sampling.

Owns: the ``/v1/chat/completions`` answer in SGLang's response models and
the routed-experts blob (`answer`), what ``/generate`` checks in a body
(`generate_params`), ``/parse_function_call`` and ``/separate_reasoning``
(`parse_memo`), and the session controller behind ``/open_session`` and
``session_params`` (`sessions`). Each module names the SGLang source it
models. May import the emulator's `model`, `faults` and the server's
`prompt`, `errors` and `tokens`; never the server's other wings.
"""
