"""`check-template` on the genuine templates: the per-family report, and that
the check catches the junction bugs real templates exposed, and the
templates whose appended pieces depend on the history."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.emulator.tokenizer import bundled_tokenizer_path
from rollout_session.prompt import check
from rollout_session.prompt.check import (
    Case,
    Outcome,
    canonical_cases,
    check_template,
    format_report,
    rendered_whole,
    role_fix,
    run_case,
    startup_problems,
    startup_refusal,
)
from rollout_session.prompt.junction import continuation
from rollout_session.prompt.model_output import answer_ids
from rollout_session.prompt.tokenizer import ChatTokenizer, load_tokenizer
from tests import FIXTURES
from tests.families import family_tokenizer, model_tokenizer

E, R, U, C = Outcome.EXACT, Outcome.REWRITES, Outcome.UNSUPPORTED, Outcome.CORRUPT
H = Outcome.HISTORY_DEPENDENT
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
# sampled <|return|>);
# H: the appended messages render otherwise after the real history
# (Mistral moves the system prompt and the tools list into the last user
# turn; DeepSeek-R1 opens a second round of tool outputs as a continuation
# of the first): the template is served rendered whole;
# U: the template (or, for a dropped or moved message, the server) refuses.
REPORT: dict[str, tuple[Outcome, ...]] = {
    "qwen2.5": (E, E, E, E, E, E, U),
    "qwen3": (R, R, R, R, R, R, U),
    "qwen3-coder": (E, E, E, E, E, E, E),
    "llama-3.1": (E, E, U, E, E, E, E),
    "llama-3.2": (E, E, U, E, E, E, E),
    "deepseek-v3.1": (E, E, E, E, E, U, U),
    "deepseek-r1": (R, H, H, R, R, U, U),
    "glm-4.6": (E, E, E, R, E, R, U),
    "kimi-k2": (E, E, E, E, E, E, E),
    "gpt-oss": (R, R, R, R, E, U, U),
    "mistral-nemo": (H, H, H, H, H, U, U),
}


@pytest.mark.parametrize("family", list(REPORT))
def test_report_per_family(family: str) -> None:
    results = check_template(family_tokenizer(family), {})
    assert [r.name for r in results] == list(CASES)
    assert {r.name: r.outcome for r in results} == dict(zip(CASES, REPORT[family], strict=True))
    # No family is corrupt, and with the default append roles every one serves.
    assert startup_problems(results, {"tool", "user"}) == []
    # Rendered whole exactly when a case is history-dependent.
    assert list(rendered_whole(results)) == ([None] if H in REPORT[family] else [])


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


# --- Templates beyond the families (tests/fixtures/templates/more.json) ---

NAMED_CASES = (
    ("default", "plain", E),
    ("default", "reasoning", E),
    ("default", "cut by max_tokens", E),
    ("default", "appended system message", E),
    ("default", "appended developer message", E),
    ("tool_use", "plain", E),
    # Hermes renders a tool result with a newline when more follows.
    ("tool_use", "tool call", R),
    ("tool_use", "parallel tool calls", R),
    ("tool_use", "reasoning", E),
    ("tool_use", "cut by max_tokens", E),
    ("tool_use", "appended system message", E),
    ("tool_use", "appended developer message", U),
)


def test_each_named_template_is_checked_on_the_requests_it_serves() -> None:
    """Hermes 3: `default` on the cases without tools, `tool_use` on every
    case with tools; the report names each template."""
    results = check_template(model_tokenizer("hermes-3"), {})
    assert [(r.template, r.name, r.outcome) for r in results] == list(NAMED_CASES)
    assert startup_refusal(results, {"tool", "user"}) is None
    report = format_report(results)
    assert "chat template 'default' (requests without tools):\n  plain" in report
    assert "chat template 'tool_use' (requests with tools):\n  plain" in report


def test_a_tools_only_template_does_not_fail_start_up() -> None:
    """Served alone, Hermes' `tool_use` cannot render a request without
    tools: those cases are unsupported with the reason, not corrupt with the
    template's TypeError, and the server starts."""
    results = check_template(model_tokenizer("hermes-3", "tool_use"), {})
    without = [r for r in results if r.name not in ("tool call", "parallel tool calls")]
    assert {r.outcome for r in without} == {U}
    assert all("renders only with tools" in r.detail for r in without)
    assert "TypeError" not in format_report(results)
    assert startup_problems(results, {"tool", "user"}) == []


def test_a_template_ending_every_last_turn_with_a_generation_prompt_is_served() -> None:
    """Command-R7B's tool-use template was refused ("renders the previous
    answer's tool calls differently when messages follow"): served now,
    rendered whole for its numbered tool results (below), exact otherwise."""
    results = check_template(model_tokenizer("command-r7b"), {})
    assert {r.name: r.outcome for r in results} == dict(
        zip(CASES, (E, H, H, E, E, E, U), strict=True)
    )
    assert startup_refusal(results, {"tool", "user", "system"}) is None


def _rounds(case: Case, rounds: int) -> Case:
    """`case` cut after `rounds` answers, the next turn's messages appended last."""
    return Case(case.name, case.turns[:rounds], case.turns[rounds].new, case.tools)


def test_numbered_tool_results_show_from_the_second_tool_round() -> None:
    """Command-R7B numbers tool calls across the conversation, and a tool
    result names its call by that number. After one tool round the junction's
    synthetic context numbers it as the history does ("0"); from the second
    on it does not ("0" where a full render has "1"). The check had one
    tool round per case, so it reported the template exact."""
    tok = model_tokenizer("command-r7b")
    [case] = [c for c in canonical_cases(tok) if c.name == "tool call"]
    one = run_case(tok, _rounds(case, 1), {})
    assert (one.outcome, one.detail) == (E, "")
    two = run_case(tok, case, {})
    assert (two.outcome, two.at) == (H, (frozenset({"tool"}),))
    assert two.detail == (
        "turn 3: the appended messages render otherwise after the real history: "
        "sent '0' where a full render has '1'"
    )
    # Rendered whole, the render starts with the session's ids: no segment starts.
    assert two.whole == ""


def test_check_template_says_how_a_history_dependent_template_is_served() -> None:
    """The report names the case, the turn and the differing text, and what
    rendering whole does to it; `rendered_whole` the template, the mode and
    its cost (what `serve` logs and `check-template` prints after the
    report)."""
    results = check_template(model_tokenizer("command-r7b"), {})
    assert (
        "tool call                   history-dependent: turn 3: the appended messages render "
        "otherwise after the real history: sent '0' where a full render has '1'; rendered "
        "whole, every turn continues the session"
    ) in format_report(results).splitlines()
    [(name, line)] = rendered_whole(results).items()
    assert name is None
    assert line.startswith(
        "the chat template renders appended messages from the history (tool call, "
        "parallel tool calls): it is served rendered whole, each later turn rendering the "
        "whole conversation (and tokenising it where the appended messages render otherwise "
        "after it), a cost that grows with the history"
    )


HISTORY_TEMPLATES = FIXTURES / "history-templates"


@pytest.mark.parametrize(
    ("template", "outcomes", "detail", "whole"),
    [
        (
            "counts-users",
            (H, E, E, H, H, H, H),
            "turn 3: the appended messages render otherwise after the real history: sent '2' "
            "where a full render has '3'",
            "",
        ),
        (
            "counts-users-upper-first",
            (H, R, R, H, H, H, H),
            "turn 3: the appended messages render otherwise after the real history: sent '2' "
            "where a full render has '3'",
            "turn 3 starts a new segment: its appended messages render otherwise after the real "
            "history, and the render rewrites the session's ids ('You are a' became 'YOU ARE A')",
        ),
        (
            # The render ends with the junction's ids, after the system block
            # it moves there: the ids alone show only a rewritten history.
            "moves-system",
            (H, H, H, H, H, E, E),
            "turn 2: the appended messages render otherwise after the real history",
            "turn 2 starts a new segment: its appended messages render otherwise after the real "
            "history, and the render rewrites the session's ids ('system\\nYou' became "
            "'user\\nHello')",
        ),
    ],
    ids=["counts", "counts-and-rewrites", "moves-system"],
)
def test_templates_whose_appended_messages_depend_on_the_history(
    template: str, outcomes: tuple[Outcome, ...], detail: str, whole: str
) -> None:
    """Numbered user messages: the second appended user message is "#2"
    after the synthetic context, "#3" after the real history. A system
    message written before the last user message: each appended user message
    takes it. Rendered whole, a turn whose render does not start with the
    session's ids (the template rewrites them) starts a new segment."""
    tok = load_tokenizer(bundled_tokenizer_path(), str(HISTORY_TEMPLATES / f"{template}.jinja"))
    results = check_template(tok, {})
    assert tuple(r.outcome for r in results) == outcomes
    plain = results[0]
    assert (plain.detail.split("; ")[0], plain.whole) == (detail, whole)
    assert plain.detail.endswith(f"rendered whole, {whole or 'every turn continues the session'}")
    assert list(rendered_whole(results)) == [None]


def test_a_rewriting_template_rendered_whole_keeps_the_ids_it_rewrites() -> None:
    """DeepSeek-R1 is rendered whole (its second round of tool outputs
    opens as a continuation of the first). Its plain turns' render strips
    the sampled reasoning, but the template appends them alike after the
    real history: the session keeps what the model saw, as token-in/token-out
    does. Its second tool round renders otherwise, and the render does not
    start with the session's ids: a new segment."""
    results = {r.name: r for r in check_template(family_tokenizer("deepseek-r1"), {})}
    assert (results["plain"].outcome, results["plain"].whole) == (R, "")
    assert "rendered whole" not in results["plain"].detail
    assert results["tool call"].outcome is H
    assert results["tool call"].whole.startswith("turn 3 starts a new segment")


@pytest.mark.parametrize(
    ("family", "roles", "fix"),
    [
        ("phi-3.5-mini", {"tool", "user"}, "start with --append-roles user (an appended tool"),
        ("phi-3.5-mini", {"tool", "user", "system", "developer"},
         "start with --append-roles system,user (an appended developer or tool"),
        ("drops-history", {"tool", "user"}, "serve a template the server can extend with "
         "--chat-template FILE"),
    ],
    ids=["drops-tool", "drops-tool-and-developer", "no-role-helps"],
)  # fmt: skip
def test_a_refusal_names_the_fix_on_its_first_line(
    family: str, roles: set[str], fix: str, hf_tokenizer: Any
) -> None:
    """Phi-3.5 drops tool messages: --append-roles user starts (a tool result
    then starts a new segment). No --append-roles helps a template that drops
    the history: another template must be served."""
    if family == "drops-history":
        text = (FIXTURES / "broken-templates" / "drops-history.jinja").read_text("utf-8")
        tok = ChatTokenizer(hf_tokenizer, text)
    else:
        tok = model_tokenizer(family)
    results = check_template(tok, {})
    refusal = startup_refusal(results, roles)
    assert refusal is not None
    first = refusal.splitlines()[0]
    assert first.startswith("the chat template cannot be extended token-in/token-out exactly; ")
    assert fix in first
    suggested = role_fix(results, roles)
    assert suggested is None or startup_refusal(results, suggested) is None
