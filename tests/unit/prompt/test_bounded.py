"""Counting a text's tokens piece by piece: a lower bound, and bounded work."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rollout_session.emulator.tokenizer import bundled_tokenizer_path
from rollout_session.prompt import bounded
from rollout_session.prompt.bounded import PromptTooLong, encode_within, tokens_at_least

Encode = Callable[[str], list[int]]

_TEXT = (
    "the quick brown fox jumps over a lazy dog , . ; : ! ? ( ) [ ] { } \" ' - _ = + * / "
    "def return 0 1 12 123 1234 3.14 αβγ καλημέρα 日本語 テスト 中文 😀 naïve café"
)
_WORDS = _TEXT.split()
_SEPARATORS = (" ", " ", " ", "  ", "\n", "\n\n", " \n", "\t", "   \n  ")


def _text(rng: random.Random, words: int) -> str:
    pieces = []
    for _ in range(words):
        pieces.append(rng.choice(_WORDS))
        pieces.append(rng.choice(_SEPARATORS))
    return "".join(pieces)


def _trained(pre: pre_tokenizers.PreTokenizer, decoder: decoders.Decoder) -> Encode:
    """A small BPE tokenizer with `pre`, trained on the test's own texts."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=True))
    tok.pre_tokenizer = pre
    tok.decoder = decoder
    corpus = [_text(random.Random(seed), 400) for seed in range(20)]
    corpus.append(" " * 300 + "\n" * 40 + "x" * 300)
    trainer = trainers.BpeTrainer(
        vocab_size=1500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _bundled() -> Encode:
    tok = Tokenizer.from_file(str(bundled_tokenizer_path() / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


TOKENIZERS: dict[str, Callable[[], Encode]] = {
    # The bundled vocabulary (DeepSeek's: regex splits, then byte-level BPE).
    "bundled": _bundled,
    # GPT-2's byte-level pre-tokenizer with its regex.
    "byte-level": lambda: _trained(
        pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    ),
    # SentencePiece-style: spaces become ▁, a ▁ prefixed to every text.
    "metaspace": lambda: _trained(
        pre_tokenizers.Metaspace(prepend_scheme="always"), decoders.Metaspace()
    ),
    # Whitespace kept inside pieces: only punctuation and digits split.
    "no-split": lambda: _trained(
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=False)]),
        decoders.ByteLevel(),
    ),
}


@pytest.fixture(params=TOKENIZERS, ids=list(TOKENIZERS))
def encode(request: pytest.FixtureRequest) -> Encode:
    return TOKENIZERS[request.param]()


@pytest.mark.parametrize("piece_chars", [8, 33, 128], ids=["8", "33", "128"])
def test_the_count_never_exceeds_the_whole_texts_tokens(
    encode: Encode, piece_chars: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small pieces make many cuts, in words, whitespace runs and multi-byte
    characters alike: the bound stays at or under the true count."""
    monkeypatch.setattr(bounded, "PIECE_CHARS", piece_chars)
    rng = random.Random(piece_chars)
    texts = [_text(rng, rng.randrange(20, 300)) for _ in range(60)]
    texts += [" " * 2000, "\n" * 500, "x" * 1500, "日本語" * 300, "a " * 700, "😀" * 400]
    for text in texts:
        whole = len(encode(text))
        assert tokens_at_least(encode, text, 10**9) <= whole, repr(text[:80])


def test_counting_stops_once_the_room_is_used_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusing a long text tokenises about the room's worth of it, whatever
    the text's length."""
    whole = _bundled()
    seen: list[int] = []

    def counting(text: str) -> list[int]:
        seen.append(len(text))
        return whole(text)

    text = _text(random.Random(0), 600_000)  # ~3.5 MB
    with pytest.raises(PromptTooLong) as refused:
        encode_within(counting, text, 20_000)
    assert refused.value.at_least > 20_000
    # ~16k tokens a piece: two pieces pass the room, nothing more is read.
    assert sum(seen) <= 3 * bounded.PIECE_CHARS < len(text) // 10


def test_a_fitting_text_gets_its_exact_ids() -> None:
    encode = _bundled()
    text = _text(random.Random(1), 30_000)
    ids = encode(text)
    assert encode_within(encode, text, len(ids)) == ids  # exactly full: fits
    with pytest.raises(PromptTooLong):
        encode_within(encode, text, len(ids) // 2)
    assert encode_within(encode, text, None) == ids


def test_a_text_shorter_than_the_room_in_bytes_is_not_counted() -> None:
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return list(range(len(text.encode())))

    # 6 bytes: at most 7 tokens (a SentencePiece prefix), within a room of 7
    assert encode_within(encode, "héllo", 7) == [0, 1, 2, 3, 4, 5]
    assert calls == ["héllo"]  # one call: the text's own encoding
