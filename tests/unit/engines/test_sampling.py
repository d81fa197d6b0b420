"""What a completion records of its sampling: every key, by its OpenAI name,
None where the engine left it to the worker."""

from __future__ import annotations

from rollout_session.engines.sampling import SAMPLING_KEYS, applied


def test_every_key_is_recorded_by_its_openai_name() -> None:
    sent = {"temperature": 0.5, "max_new_tokens": 32, "sampling_seed": 3, "ignored": 1}
    got = applied(sent, {"max_tokens": "max_new_tokens", "seed": "sampling_seed"})
    assert list(got) == list(SAMPLING_KEYS)
    assert (got["temperature"], got["max_tokens"], got["seed"]) == (0.5, 32, 3)
    assert got["top_p"] is None  # the worker's own default applied
