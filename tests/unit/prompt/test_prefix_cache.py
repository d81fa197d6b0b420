"""The shared-prefix cache: first prompts' ids equal a whole tokenisation on
every family's template, different tools or kwargs never hit, and a cut is
made only where the tokenizer cannot merge across it."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from rollout_session.prompt.bounded import PromptTooLong
from rollout_session.prompt.prefix_cache import PrefixCache
from rollout_session.prompt.tokenizer import ChatTokenizer
from tests.conftest import OTHER_TOOLS, TOOLS
from tests.families import FAMILIES, family_tokenizer

# A long system prompt ending in a word, a number and punctuation: text the
# template's end-of-message token follows, where a merge would show.
SYSTEM = (
    "You are a coding agent working in a repository. Read files before you edit them; "
    "run the tests after every change, and say what you changed. " * 12 + "Version 42!"
)


def first_prompt(tok: ChatTokenizer, task: str, **kwargs: Any) -> tuple[list[int], list[int]]:
    """(the ids `first_turn` gives, the whole rendering's ids)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    tools = kwargs.pop("tools", TOOLS)
    ids = tok.first_turn(messages, tools=tools, kwargs=kwargs)
    text = tok.render(messages, tools=tools, kwargs=kwargs, add_generation_prompt=True)
    return ids, tok.encode(text)


@pytest.mark.parametrize("family", FAMILIES)
def test_first_prompts_from_the_cache_equal_a_whole_tokenisation(family: str) -> None:
    tok = family_tokenizer(family)
    hits = tok.prefixes.hits
    tasks = ["Fix the failing test.", " leading space", "\n\nnewlines first", "日本語で", "42"]
    for task in tasks:
        ids, whole = first_prompt(tok, task)
        assert ids == whole, task
    # Every one was made from the cached prefix (the first made the entry),
    # unless the template renders the system message differently when more
    # follows: then none.
    assert tok.prefixes.hits - hits in (0, len(tasks))


def test_the_families_templates_do_share_their_heads() -> None:
    """The families whose templates render the system message alone as they
    do before a user message use the cache: it is not a no-op."""
    for family in ("qwen3", "qwen2.5", "qwen3-coder", "glm-4.6", "kimi-k2", "gpt-oss"):
        tok = family_tokenizer(family)
        hits = tok.prefixes.hits
        first_prompt(tok, "one")
        first_prompt(tok, "two")
        assert tok.prefixes.hits == hits + 2, family


@pytest.mark.parametrize(
    "other",
    [{"tools": OTHER_TOOLS}, {"tools": None}, {"enable_thinking": False}],
    ids=["other-tools", "no-tools", "other-kwargs"],
)
def test_other_tools_or_kwargs_never_hit(other: dict[str, Any]) -> None:
    tok = family_tokenizer("qwen3")
    first_prompt(tok, "warm the cache")
    entries = dict(tok.prefixes._entries)
    ids, whole = first_prompt(tok, "same task", **other)
    assert ids == whole
    made = tok.prefixes._entries.keys() - entries.keys()
    assert len(made) == 1  # a key of its own, not the warm one


def test_a_bound_counts_the_cached_prefix() -> None:
    tok = family_tokenizer("qwen3")
    ids, _ = first_prompt(tok, "short")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x " * 4000}]
    with pytest.raises(PromptTooLong) as refused:
        tok.first_turn(messages, tools=TOOLS, kwargs={}, most=len(ids) + 100)
    assert refused.value.at_least > len(ids) + 100


def _tokenizer(pre: pre_tokenizers.PreTokenizer, decoder: decoders.Decoder) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=True))
    tok.pre_tokenizer = pre
    tok.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["hello world, a b c 1 2 3 日本 " * 20], trainer)
    tok.add_special_tokens(
        [
            AddedToken("<end>", special=True),
            AddedToken("<end_strip>", special=True, rstrip=True),
            AddedToken("<pre>", special=True),
            AddedToken("<pre>!", special=True),
        ]
    )
    return tok


@pytest.mark.parametrize(
    ("pre", "safe"),
    [
        (pre_tokenizers.ByteLevel(add_prefix_space=False), {"<end>"}),
        # SentencePiece-style: a ▁ is put before the first piece of a text,
        # so a rest tokenised alone differs: no cut is safe.
        (pre_tokenizers.Metaspace(prepend_scheme="first"), set()),
    ],
    ids=["byte-level", "metaspace-first"],
)
def test_cuts_are_made_only_where_the_tokenizer_cannot_merge(
    pre: pre_tokenizers.PreTokenizer, safe: set[str]
) -> None:
    tok = _tokenizer(pre, decoders.ByteLevel())

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    added = [(t.content, t.special, t.rstrip) for t in tok.get_added_tokens_decoder().values()]
    cache = PrefixCache(encode, added)
    # <end_strip> strips what follows it; <pre> begins <pre>!.
    assert {"<end>", "<end_strip>", "<pre>"} & cache._candidates == {"<end>"}
    head = "hello world " * 30 + "<end>\nmore <end_strip>  "
    expected = "hello world " * 30 + "<end>" if "<end>" in safe else ""
    entry = cache.lookup(b"k", head + "rest", lambda: head)
    assert (entry[0] if entry else "") == expected
    if entry is not None:
        prefix, ids = entry
        assert [*ids, *encode(head[len(prefix) :] + "rest")] == encode(head + "rest")


def test_a_hit_that_differs_from_the_whole_is_caught(caplog: pytest.LogCaptureFixture) -> None:
    """Checked hits (every one here) fall back to the whole ids, loudly, and
    turn the cache off."""

    def encode(text: str) -> list[int]:
        return [len(text)]  # a "tokenizer" whose pieces never add up

    cache = PrefixCache(encode, [("<end>", True, False)], verify_every=1)
    cache._verdicts["<end>"] = True  # as if the probe had passed
    head = "x" * 300 + "<end>"
    entry = cache.lookup(b"k", head + "rest", lambda: head)
    assert entry is not None
    _, ids = entry
    with caplog.at_level(logging.ERROR):
        assert cache.checked(head + "rest", [*ids, len("rest")]) == [len(head) + 4]
    assert not cache.enabled and "the cache is off" in caplog.text
    assert cache.lookup(b"k", head + "rest", lambda: head) is None
