"""SGLang's ``/v1/chat/completions`` with ``input_ids``: the `sglang-chat` engine.

`engine.SGLangChatEngine` builds the worker's request from the agent's and
the exact prompt ids, sends it through the pool, and validates the answer
with `answer.check_answer` (strict, pure, picklable: validation processes
import `answer` alone, so this package's ``__init__`` imports nothing).
"""
