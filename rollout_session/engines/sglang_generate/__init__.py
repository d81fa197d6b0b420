"""The `sglang-generate` engine: SGLang's native ``/generate`` with the prompt
ids, sampling parameters translated as SGLang's chat route translates them,
answers parsed by SGLang's own parsers on the worker (docs/engines.md).

Owns: the translation (`request`), the answer check (`answer`), the parser
calls (`parsers`) and the agent's chat completion (`reply`). May import the
engine seam, the pool and the top-level `errors`/`tokens`; never `session`,
`turn` or `http`.
"""

from .engine import SGLangGenerateEngine
from .parsers import Parsers
from .request import GenerateOptions, read_sampling_defaults

__all__ = ["GenerateOptions", "Parsers", "SGLangGenerateEngine", "read_sampling_defaults"]
