"""What SGLang 0.5.23 checks of the launch flags the emulator takes, for `EmulatorConfig`.

``--tool-call-parser`` and ``--reasoning-parser`` are argparse choices
(``server_args.py`` ``ServerArgs.add_cli_args``: ``["auto"]`` and the
registries of `names`); ``--preferred-sampling-params`` is a JSON object
checked by ``arg_groups/serving_hook.py`` ``handle_other_validations``
("watermark" refused; with ``--skip-tokenizer-init`` it must also pass
``SamplingParams(**params).normalize(None)``, i.e. name no stop string,
stop regex or ``min_new_tokens``: ``srt/sampling/sampling_params.py``
``raise_if_tokenizer_required``). What SGLang accepts and the emulator does
not model is refused too, saying so (`names.unmodelled_parser`; preferred
parameters SGLang would fail every request on, or that would constrain the
chat route's grammar). Light: no import beyond `names`, `contract_gate` and `generate_params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout_session.emulator.sglang.contract_gate import contract_error
from rollout_session.emulator.sglang.generate_params import tokenizer_required
from rollout_session.emulator.sglang.names import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    invalid_choice,
    unmodelled_parser,
)

__all__ = ["check_sglang_launch"]

# The grammars the chat route's sampling parameters leave unset unless the
# request sets one (protocol.py ChatCompletionRequest.to_sampling_params), so
# preferred ones would constrain its requests (the merge keeps the request's keys).
_GRAMMARS = ("json_schema", "structural_tag")


def check_sglang_launch(
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    preferred_sampling_params: Mapping[str, Any] | None,
    skip_tokenizer_init: bool,
) -> None:
    """Raise ValueError as SGLang's launch refuses these flags (or as the
    emulator refuses what it does not model)."""
    for flag, value, names in (
        ("--tool-call-parser", tool_call_parser, TOOL_CALL_PARSERS),
        ("--reasoning-parser", reasoning_parser, REASONING_PARSERS),
    ):
        if value is None:
            continue
        if value != "auto" and value not in names:
            raise ValueError(invalid_choice(flag, value, names))
        why = unmodelled_parser(flag, value)
        if why is not None:
            raise ValueError(why)
    if preferred_sampling_params is not None:
        _check_preferred(preferred_sampling_params, skip_tokenizer_init)


def _check_preferred(params: Mapping[str, Any], skip_tokenizer_init: bool) -> None:
    """``handle_other_validations`` on ``--preferred-sampling-params``."""
    if not isinstance(params, Mapping):
        raise ValueError("--preferred-sampling-params must be a JSON object")  # noqa: TRY004
    if "watermark" in params:
        raise ValueError("watermark is not supported in --preferred-sampling-params")
    # TokenizerManager._create_tokenized_object builds SamplingParams(**{**preferred,
    # **request}) for every request: what its type checks or msgspec refuse there
    # fails every request (a 500), which the emulator does not serve.
    error = contract_error({"sampling_params": dict(params)})
    if error is not None or "choice" in params:
        raise ValueError(
            "the emulator does not model --preferred-sampling-params that SGLang's "
            f"SamplingParams fails on for every request ({error or 'choice'})"
        )
    grammar = next((key for key in _GRAMMARS if params.get(key)), None)
    if grammar is not None:
        raise ValueError(
            f"the emulator does not model a server-wide {grammar} in "
            "--preferred-sampling-params (it would constrain every chat request without one)"
        )
    if skip_tokenizer_init:
        message = tokenizer_required(params)
        if message is not None:
            raise ValueError(message)
