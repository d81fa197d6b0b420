"""`check-template` on the genuine templates: the per-family report, and that
the check catches the junction bugs real templates exposed."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.prompt import check
from rollout_session.prompt.check import Outcome, check_template, startup_problems
from rollout_session.prompt.junction import continuation
from rollout_session.prompt.model_output import answer_ids
from tests.families import family_tokenizer

E, R, U, C = Outcome.EXACT, Outcome.REWRITES, Outcome.UNSUPPORTED, Outcome.CORRUPT
CASES = (
    "plain",
    "tool call",
    "parallel tool calls",
    "reasoning",
    "cut by max_tokens",
    "appended system message",
    "appended developer message",
)
# The report of `rollout-session check-template` per family (docs/templates.md).
# R: the template re-renders history differently from what was sampled
# (Qwen3 and DeepSeek-R1 strip reasoning, harmony writes <|end|> for the
# sampled <|return|>, Mistral moves the system prompt and the tools
# list to the last user turn);
# U: the template (or, for a dropped or moved message, the server) refuses.
REPORT: dict[str, tuple[Outcome, ...]] = {
    "qwen2.5": (E, E, E, E, E, E, U),
    "qwen3": (R, R, R, R, R, R, U),
    "qwen3-coder": (E, E, E, E, E, E, E),
    "llama-3.1": (E, E, U, E, E, E, E),
    "llama-3.2": (E, E, U, E, E, E, E),
    "deepseek-v3.1": (E, E, E, E, E, U, U),
    "deepseek-r1": (R, R, R, R, R, U, U),
    "glm-4.6": (E, E, E, R, E, R, U),
    "kimi-k2": (E, E, E, E, E, E, E),
    "gpt-oss": (R, R, R, R, E, U, U),
    "mistral-nemo": (R, R, R, R, R, U, U),
}


@pytest.mark.parametrize("family", list(REPORT))
def test_report_per_family(family: str) -> None:
    results = check_template(family_tokenizer(family), {})
    assert [r.name for r in results] == list(CASES)
    assert {r.name: r.outcome for r in results} == dict(zip(CASES, REPORT[family], strict=True))
    # No family is corrupt, and with the default append roles every one serves.
    assert startup_problems(results, {"tool", "user"}) == []


@pytest.mark.parametrize(
    ("family", "roles", "refused"),
    [
        ("deepseek-v3.1", {"tool", "user", "system"}, ["appended system message"]),
        ("qwen3", {"tool", "user", "developer"}, ["appended developer message"]),
        ("qwen3", {"tool", "user", "system"}, []),
        # The template's own raise_exception is the agent's 400, not a refusal.
        ("mistral-nemo", {"tool", "user", "system"}, []),
    ],
    ids=["deepseek-system", "qwen3-developer", "qwen3-system", "mistral-raises"],
)
def test_start_up_refuses_only_reachable_server_failures(
    family: str, roles: set[str], refused: list[str]
) -> None:
    problems = startup_problems(check_template(family_tokenizer(family), {}), roles)
    assert [p.split(":")[0] for p in problems] == refused
    assert all(f"drop {p.split()[1]} from --append-roles" in p for p in problems)


def _naive(sampled: Any, junction: Any, **_: Any) -> list[int]:
    """The junction before templates were probed: the template's whole
    continuation after the sampled ids, whatever they ended with."""
    return list(junction.ids)


@pytest.mark.parametrize("family", ["glm-4.6", "qwen2.5", "llama-3.1"])
def test_the_check_catches_duplicated_junction_tokens(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GLM's sampled <|user|> followed by the template's <|user|>, or a second
    <|im_end|> / <|eot_id|>: every such junction is reported corrupt."""
    monkeypatch.setattr(check, "continuation", _naive)
    results = {r.name: r for r in check_template(family_tokenizer(family), {})}
    assert results["plain"].outcome is C
    assert "turn junction" in results["plain"].detail
    assert startup_problems(list(results.values()), {"tool", "user"})


def test_llama_builtin_tool_call_ends_on_eom_without_an_added_eot() -> None:
    """Llama 3.1's built-in tools: the model samples <|eom_id|> and history has
    <|eom_id|> too; the server must not add the <|eot_id|> of a plain turn."""
    tok = family_tokenizer("llama-3.1")
    kwargs = {"builtin_tools": ["brave_search"]}
    history = [{"role": "user", "content": "Search the news."}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "brave_search", "arguments": {"query": "news"}}}  # fmt: skip
    answer = {"role": "assistant", "content": "", "tool_calls": [call]}
    sampled = answer_ids(tok, history, answer, tools=None, kwargs=kwargs)
    assert tok.decode_pieces(sampled[-1:]) == ["<|eom_id|>"]
    result = [{"role": "tool", "tool_call_id": "c1", "content": "no news"}]
    junction = tok.junction(answer, result, tools=None, kwargs=kwargs)
    delta = continuation(sampled, junction, stopped=True, special_ids=tok.special_ids)
    server = [*tok.first_turn(history, tools=None, kwargs=kwargs), *sampled, *delta]
    assert server == tok.first_turn([*history, answer, *result], tools=None, kwargs=kwargs)
    assert "<|eot_id|>" not in tok.decode_pieces(delta[:1])
