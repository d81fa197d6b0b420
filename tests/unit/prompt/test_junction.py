"""Turn junctions: what follows an answer's sampled ids (pure rules)."""

from __future__ import annotations

import pytest

from rollout_session.prompt.junction import Junction, continuation, terminator_length

# Token ids standing for: END (history terminator, e.g. <|im_end|>, special),
# NL (plain), ROLE (next message's marker, special), W (a word), EOM and RET
# (other special stop tokens).
END, NL, ROLE, W, EOM, RET, OTHER = 1, 2, 3, 4, 5, 6, 7
SPECIAL = frozenset({END, ROLE, EOM, RET})


@pytest.mark.parametrize(
    ("last", "history", "expected"),
    [
        ((END, NL), (END, NL, ROLE, W), 2),
        ((RET,), (END, ROLE, W), 1),
        ((), (ROLE, NL, W), 0),
        ((OTHER,), (NL, ROLE), 0),
    ],
    ids=["same-terminator", "other-special-terminator", "no-terminator", "plain-text-history"],
)
def test_terminator_length(last: tuple[int, ...], history: tuple[int, ...], expected: int) -> None:
    assert terminator_length(last, history, SPECIAL) == expected


@pytest.mark.parametrize(
    ("sampled", "junction", "stopped", "expected"),
    [
        # ChatML: the sampled <|im_end|> is the terminator's first token.
        ([W, END], Junction((END, NL, ROLE, W), 2), True, [NL, ROLE, W]),
        # A model that also sampled the newline.
        ([W, END, NL], Junction((END, NL, ROLE, W), 2), True, [ROLE, W]),
        # GLM: no terminator; the sampled stop token is the next role marker.
        ([W, ROLE], Junction((ROLE, NL, W), 0), True, [NL, W]),
        # GLM, another role follows: the sampled marker stays, nothing dropped.
        ([W, EOM], Junction((ROLE, NL, W), 0), True, [ROLE, NL, W]),
        # Llama <|eom_id|> / harmony <|return|> stand in for the terminator.
        ([W, EOM], Junction((END, ROLE, W), 1), True, [ROLE, W]),
        ([W, RET], Junction((END, ROLE, W), 1), True, [ROLE, W]),
        # Cut by max_tokens: the whole terminator is appended.
        ([W, W], Junction((END, NL, ROLE), 2), False, [END, NL, ROLE]),
        # A special token that was cut at (not a stop) never stands in.
        ([W, EOM], Junction((END, ROLE), 1), False, [END, ROLE]),
        # A stop string (plain text) keeps the template's terminator.
        ([W, W], Junction((END, NL, ROLE), 2), True, [END, NL, ROLE]),
        # Overlap is bounded by the terminator: a word that happens to start
        # the next message is not taken as already there.
        ([NL, ROLE, W], Junction((END, NL, ROLE, W), 0), True, [END, NL, ROLE, W]),
        ([], Junction((END, NL), 2), False, [END, NL]),
    ],
    ids=[
        "eos-sampled",
        "eos-and-newline-sampled",
        "role-marker-stop",
        "role-marker-mismatch",
        "eom-for-eot",
        "return-for-end",
        "length-cut",
        "cut-on-special",
        "stop-string",
        "bounded-overlap",
        "empty",
    ],
)
def test_continuation(
    sampled: list[int], junction: Junction, stopped: bool, expected: list[int]
) -> None:
    assert continuation(sampled, junction, stopped=stopped, special_ids=SPECIAL) == expected
