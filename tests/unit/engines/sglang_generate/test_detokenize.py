"""The text of a ``--skip-tokenizer-init`` worker's ids, decoded here as
SGLang's detokenizer decodes them: compared, family by family, with SGLang
0.5.23's own detokenizer code (`tests.sglang_source.load_detokenizer`: its
functions compiled from the wheel, driven as its scheduler hands it a
non-streamed answer), over answers that cross its 50-token hand-offs,
split a character's bytes across one, end on a stop token, a stop string or
the length limit, with special tokens skipped or kept."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.engines.sglang_generate.detokenize import FORCE_STREAM_INTERVAL, Detokenizer
from tests.families import FAMILIES, family_tokenizer
from tests.sglang_source import load_detokenizer, or_skip

# A character byte-level BPE vocabularies split into several tokens.
SPLIT = "𠜎"
TEXT = "The weather in Paris is mild today, with a light breeze from the west. "


def answers(tokenizer: Any, stop: int) -> dict[str, tuple[list[int], dict[str, Any]]]:
    """(output ids, finish_reason) of the cases: short, long, a character cut
    by a hand-off, stopped by a string, cut by the length limit."""

    def encode(text: str) -> list[int]:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        return ids

    short = encode("Hello there!")
    long = encode(TEXT * 12)
    split = encode(SPLIT)
    assert len(split) >= 2, "the case needs a character in several tokens"
    # Pad so that a hand-off falls between the character's tokens.
    pad = encode("a " * 200)[: FORCE_STREAM_INTERVAL - 1]
    cut = [*pad, *split, *encode(" and after " + TEXT)]
    return {
        "short-stop-token": ([*short, stop], {"type": "stop", "matched": stop}),
        "long-stop-token": ([*long, stop], {"type": "stop", "matched": stop}),
        "character-across-a-hand-off": ([*cut, stop], {"type": "stop", "matched": stop}),
        "stop-string": (long, {"type": "stop", "matched": "breeze"}),
        "length": (long[:120], {"type": "length", "length": 120}),
    }


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
@pytest.mark.parametrize("family", FAMILIES)
def test_text_is_what_sglang_decodes(family: str, skip: bool) -> None:
    sglang_text = or_skip(load_detokenizer)
    chat = family_tokenizer(family)
    tokenizer = chat.hf
    stop = min(chat.stop_ids) if chat.stop_ids else tokenizer.eos_token_id
    prompt = tokenizer.encode("<prompt> what is the weather?", add_special_tokens=False)
    ours = Detokenizer(tokenizer, tool_call_parser=None)
    for case, (output, finish) in answers(tokenizer, stop).items():
        expected = sglang_text(tokenizer, prompt, output, finish, skip, True)
        got = ours.text(
            prompt, output, finish, skip_special_tokens=skip, spaces_between_special_tokens=True
        )
        assert got == expected, (family, case)
        assert "\ufffd" not in got, (family, case)  # the split character came out whole


def test_each_token_is_its_id_decoded_alone() -> None:
    tokenizer = family_tokenizer("qwen3").hf
    ids = tokenizer.encode("Hi " + SPLIT, add_special_tokens=False)
    texts = Detokenizer(tokenizer, tool_call_parser=None).token_texts(ids)
    assert texts == tokenizer.batch_decode([[i] for i in ids])


def test_a_parser_whose_rules_are_not_reproduced_is_refused() -> None:
    with pytest.raises(ValueError, match="response_template"):
        Detokenizer(family_tokenizer("qwen3").hf, tool_call_parser="response_template")
