"""Template conformance: does token-in/token-out stay exact with this template?

`check_template` runs canonical conversations (plain multi-turn, a tool call
and its result, parallel tool calls, reasoning, a turn cut by ``max_tokens``,
an appended system or developer message) through the server's own prompt
building (`ChatTokenizer.first_turn`, `junction`, `continuation`), with a
simulated model that samples exactly what the template renders for each
answer (`model_output.answer_ids`), and compares each turn's ids with the
template's full rendering of that request. Each case is one of:

- ``exact``: identical to a full re-render;
- ``rewrites``: the template re-renders history differently from what the
  model saw (Qwen3 strips earlier ``<think>``, harmony writes ``<|end|>``
  where ``<|return|>`` was sampled); the trajectory keeps what the model
  saw, and the report names where;
- ``unsupported``: the template (``raise_exception``) or the server refuses
  the case, with the reason; such a request fails loudly at run time;
- ``history-dependent``: the template renders the appended messages
  otherwise after the real history than after the junction's synthetic
  context (Command-R7B numbers tool results across the conversation: the
  second says ``"1"``, the junction's ``"0"``; Mistral moves the system
  prompt into the last user turn). No synthetic context can know that:
  such a template is served rendered whole (below);
- ``corrupt``: the server's prompt would differ from the template at a turn
  junction (a duplicated, missing or foreign token next to the sampled ids).

How a junction is checked, robustly to history rewriting: the server's
appended prompt P and the template's full rendering R are aligned from the
end. P must lie inside their common suffix, and the token before it (the
last sampled one) must be the template's too, or both must be special tokens
(a sampled stop token standing in for the template's history terminator). A
difference inside P itself is the template rendering the appended messages
differently after the real history: ``history-dependent``. So is a render
that ends with P after other text than the synthetic context writes before
it (a block the template moves in front of the new messages), which the ids
alone would take for rewritten history: each turn also asks the template
whether it appends alike after the real history
(`ChatTokenizer.appends_alike`). Every case has at least two junctions of
its kind (two tool rounds, two appended messages of a role), since a piece
counted over the conversation first differs at the second.

A template with a history-dependent case is served *rendered whole*
(`rendered_whole`; `turn.plan`): each later turn renders the whole request
to ask whether the template writes the appended messages after the real
history as the junction has them (`ChatTokenizer.appends_alike`); where it
does not, the turn's prompt is that render, which must start with the
session's ids, else the turn diverges (a new segment, or refused). Each case
is simulated that way too, and its line says which turn would start a
segment.

With several named templates (a tokenizer's ``default`` and ``tool_use``),
each is checked on the requests it serves: ``default`` on the cases without
tools, ``tool_use`` on every case with tools (the plain ones given the
weather tool). A template that renders only with tools has its cases without
tools ``unsupported`` (the request is refused, 400), which is no reason not
to start.

The server runs this at start-up (`startup_refusal`) and refuses to start
on ``corrupt``, or on a case its settings allow that the server itself
cannot extend; the refusal's first line names the fix (the
``--append-roles`` that would start, else ``--chat-template FILE``).
``rollout-session check-template`` prints the same report.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from ..errors import InvalidRequest, RolloutSessionError, TemplateCannotExtend
from .junction import Junction, continuation, shared_prefix
from .messages import Message
from .model_output import CallIds, answer_ids
from .tokenizer import ChatTokenizer

__all__ = [
    "Case",
    "CaseResult",
    "Outcome",
    "check_template",
    "format_report",
    "in_place_roles",
    "junction_problem",
    "reachable",
    "rendered_whole",
    "role_fix",
    "run_case",
    "startup_problems",
    "startup_refusal",
]


class Outcome(enum.Enum):
    EXACT = "exact"
    REWRITES = "rewrites history"
    HISTORY_DEPENDENT = "history-dependent"
    UNSUPPORTED = "unsupported"
    CORRUPT = "corrupt"


_RENDERS_OTHERWISE: Final = "the appended messages render otherwise after the real history"

# Which of two outcomes of a case's turns the case reports.
_RANK: Final = {
    Outcome.EXACT: 0,
    Outcome.REWRITES: 1,
    Outcome.HISTORY_DEPENDENT: 2,
    Outcome.CORRUPT: 3,
}


@dataclass(frozen=True)
class Turn:
    new: tuple[Message, ...]  # messages appended before this answer
    answer: Message
    cut: bool = False  # the answer is cut by max_tokens (no stop token)


@dataclass(frozen=True)
class Case:
    name: str
    turns: tuple[Turn, ...]
    final: tuple[Message, ...]  # messages appended after the last answer
    tools: list[Any] | None = None
    # The append role the case needs allowed (None: always reachable).
    role: str | None = None


@dataclass(frozen=True)
class CaseResult:
    name: str
    outcome: Outcome
    detail: str = ""
    role: str | None = None  # the extra append role the case is about (system, developer)
    # The roles appended at each turn the outcome showed at: the server meets
    # it only where all of one set may be appended in place (the first
    # turn's is empty: always met).
    at: tuple[frozenset[str], ...] = ()
    # The role of an appended message the template drops or moves, when that
    # is the outcome (appending it is what to stop).
    dropped: str | None = None
    template: str | None = None  # the named template the case ran with
    # Rendered whole (`turn.plan`), the first turn that would start a new
    # segment and why; empty when none would.
    whole: str = ""


_WEATHER: Final = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


_SYSTEM: Final[Message] = {"role": "system", "content": "You are a helpful agent."}


def _text(text: str, reasoning: str | None = None) -> Message:
    message: Message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _calls(ids: Sequence[str], cities: Sequence[str]) -> Message:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": i,
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": c}},
            }
            for i, c in zip(ids, cities, strict=True)
        ],
    }


def _result(call_id: str, text: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def canonical_cases(tok: ChatTokenizer) -> list[Case]:
    """The cases, each with at least two turn junctions of its kind (two
    tool rounds, two appended messages of a role): a piece the template
    renders from the history (a number counted over the conversation)
    differs from the junction's only from the second one on."""
    call_ids = CallIds(tok)
    ids = [call_ids(n) for n in range(4)]
    weather = [_WEATHER]
    return [
        Case(
            "plain",
            (
                Turn((_SYSTEM, _user("Hello there.")), _text("Hi. How can I help?")),
                Turn((_user("Tell me a fact."),), _text("Water is wet.")),
            ),
            (_user("Thanks."),),
        ),
        Case(
            "tool call",
            (
                Turn((_SYSTEM, _user("Weather in Paris, then Rome?")), _calls(ids[:1], ["Paris"])),
                Turn((_result(ids[0], "sunny"),), _calls(ids[1:2], ["Rome"])),
                Turn((_result(ids[1], "rain"),), _text("Sunny in Paris, rain in Rome.")),
            ),
            (_user("And tomorrow?"),),
            tools=weather,
        ),
        Case(
            "parallel tool calls",
            (
                Turn(
                    (_SYSTEM, _user("Weather in Paris and Rome, then Oslo and Lima?")),
                    _calls(ids[:2], ["Paris", "Rome"]),
                ),
                Turn(
                    (_result(ids[0], "sunny"), _result(ids[1], "rain")),
                    _calls(ids[2:], ["Oslo", "Lima"]),
                ),
                Turn(
                    (_result(ids[2], "snow"), _result(ids[3], "fog")),
                    _text("Sunny, rain, snow and fog."),
                ),
            ),
            (_user("Thanks."),),
            tools=weather,
        ),
        Case(
            "reasoning",
            (
                Turn((_SYSTEM, _user("What is 2+2?")), _text("It is 4.", "Two plus two is four.")),
                Turn((_user("And 3+3?"),), _text("It is 6.", "Three plus three is six.")),
            ),
            (_user("Thanks."),),
        ),
        Case(
            "cut by max_tokens",
            (
                Turn(
                    (_SYSTEM, _user("Write a long story.")),
                    _text("Once upon a time there"),
                    cut=True,
                ),
                Turn((_user("Go on."),), _text("was a king who"), cut=True),
            ),
            (_user("Thanks."),),
        ),
        *(
            Case(
                f"appended {role} message",
                (
                    Turn((_user("Hello there."),), _text("Hi. How can I help?")),
                    Turn(
                        (
                            {"role": role, "content": "Answer briefly."},
                            _user("Why is the sky blue?"),
                        ),
                        _text("Light scatters."),
                    ),
                ),
                ({"role": role, "content": "Answer in one word."}, _user("And the sea?")),
                role=role,
            )
            for role in ("system", "developer")
        ),
    ]


def _show(tok: ChatTokenizer, ids: Sequence[int]) -> str:
    return repr("".join(tok.decode_pieces(ids)))


def _where(at: int, spans: Sequence[tuple[int, int, str]]) -> str:
    for start, end, what in spans:
        if start <= at < end:
            return what
    return "the appended prompt"


def junction_problem(
    tok: ChatTokenizer,
    sampled_last: int,
    prompt: Sequence[int],
    junction: Junction,
    stopped: bool,
    server: Sequence[int],
    reference: Sequence[int],
    spans: Sequence[tuple[int, int, str]],
) -> tuple[Outcome, str] | None:
    """None when the turn's ids equal the reference, else (outcome, why)."""
    if list(server) == list(reference):
        return None

    def show(ids: Sequence[int]) -> str:
        return _show(tok, ids)

    special = tok.special_ids
    common = shared_prefix(server[::-1], reference[::-1])  # the common suffix
    # The reference's token just before the common suffix (None: it has none).
    theirs = reference[len(reference) - common - 1] if common < len(reference) else None
    theirs_shown = show([] if theirs is None else [theirs])
    if common < len(prompt):
        at = len(server) - common - 1
        return Outcome.HISTORY_DEPENDENT, (
            f"{_RENDERS_OTHERWISE}: sent {show([server[at]])} where a full render has "
            f"{theirs_shown}"
        )
    if common == len(prompt):
        ours = sampled_last
        if not stopped and list(prompt) == list(junction.ids):
            # A cut answer gets the whole terminator; the template re-renders
            # the partial answer from its parsed message, which may differ.
            return Outcome.REWRITES, (
                f"a cut answer is re-rendered differently: it ends {show([ours])}, "
                f"a full render has {theirs_shown}"
            )
        if theirs is not None and ours in special and theirs in special:
            return Outcome.REWRITES, (
                f"the sampled stop token {show([ours])} stays where history has {theirs_shown}"
            )
        if (
            ours in special
            and not junction.terminator
            and list(prompt[:1]) != [ours]
            and len(server) > common + 1
            and theirs == server[len(server) - common - 2]
        ):
            # A template with no history terminator whose stop tokens are role
            # markers (GLM): the sampled marker stays when another role follows.
            return Outcome.REWRITES, (
                f"the sampled stop token {show([ours])} stays before {show(prompt[:1])}, "
                "where a full render has none"
            )
        return Outcome.CORRUPT, (
            f"turn junction: after the sampled {show([ours])} the server appends "
            f"{show(prompt[:3])}…; a full render has {theirs_shown} before "
            f"{show(reference[len(reference) - common : len(reference) - common + 3])}"
        )
    at = next(i for i, (a, b) in enumerate(zip(server, reference, strict=False)) if a != b)
    return Outcome.REWRITES, (
        f"{_where(at, spans)} is re-rendered differently: {show(server[at : at + 3])} "
        f"became {show(reference[at : at + 3])}"
    )


class _Whole:
    """A case's session as the server keeps it when the template is served
    rendered whole (`turn.plan`), and the first turn that would start a new
    segment (`CaseResult.whole`)."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.note = ""

    def turn(self, index: int, alike: bool, prompt: Sequence[int], render: list[int]) -> None:
        """Turn `index`: the token-in/token-out `prompt` where the template
        appends `alike`, else the whole `render`, which starts a new segment
        unless it starts with the session's ids."""
        ids = self.ids
        if alike:
            self.ids = [*ids, *prompt]
            return
        self.ids = render
        if len(render) > len(ids) and render[: len(ids)] == ids:
            return
        if not self.note:
            at = shared_prefix(ids, render)
            ours, theirs = _show(self.tok, ids[at : at + 3]), _show(self.tok, render[at : at + 3])
            self.note = (
                f"turn {index + 1} starts a new segment: its appended messages render otherwise "
                f"after the real history, and the render rewrites the session's ids ({ours} "
                f"became {theirs})"
            )


def run_case(tok: ChatTokenizer, case: Case, kwargs: Mapping[str, Any]) -> CaseResult:
    """Run one case through the server's prompt building (see the module
    docstring), token-in/token-out and rendered whole."""
    messages: list[Message] = []
    ids: list[int] = []
    sampled: list[int] = []
    spans: list[tuple[int, int, str]] = []  # (start, end, what) of the server's ids
    stopped = True
    worst = Outcome.EXACT
    at: list[frozenset[str]] = []  # the appended roles of the turns `worst` showed at
    notes: list[tuple[Outcome, str]] = []
    seen: set[str] = set()
    roles: frozenset[str] = frozenset()
    whole = _Whole(tok)
    try:
        for index, turn in enumerate([*case.turns, None]):
            new = list(turn.new) if turn is not None else list(case.final)
            # A turn's own messages reach a junction only once an answer precedes them.
            roles = frozenset(str(m["role"]) for m in new) if index else frozenset()
            junction = Junction((), 0)
            if index == 0:
                prompt = tok.first_turn(new, tools=case.tools, kwargs=kwargs)
                whole.ids = list(prompt)
            else:
                junction = tok.junction(messages[-1], new, tools=case.tools, kwargs=kwargs)
                prompt = continuation(
                    sampled, junction, stopped=stopped, special_ids=tok.special_ids
                )
            messages += new
            server = [*ids, *prompt]
            spans.append((len(ids), len(server), f"the prompt of turn {index + 1}"))
            if index:
                reference = tok.first_turn(messages, tools=case.tools, kwargs=kwargs)
                alike = tok.appends_alike(
                    messages[: len(messages) - len(new) - 1],
                    messages[-len(new) - 1],
                    new,
                    tools=case.tools,
                    kwargs=kwargs,
                )
                whole.turn(index, alike, prompt, reference)
                problem = junction_problem(
                    tok, sampled[-1], prompt, junction, stopped, server, reference, spans
                )
                if not alike and (
                    problem is None or _RANK[problem[0]] < _RANK[Outcome.HISTORY_DEPENDENT]
                ):
                    # The render ends with the same ids, after more or other
                    # text than the synthetic context has before them (a
                    # block the template moves in front of the new messages).
                    problem = Outcome.HISTORY_DEPENDENT, _RENDERS_OTHERWISE
                if problem is not None:
                    outcome, why = problem
                    if why not in seen:  # named at the first turn it shows at
                        seen.add(why)
                        turn_of = (
                            f"turn {index + 1}: " if outcome is Outcome.HISTORY_DEPENDENT else ""
                        )
                        notes.append((outcome, turn_of + why))
                    if _RANK[outcome] > _RANK[worst]:
                        worst, at = outcome, []
                    if outcome is worst and roles not in at:
                        at.append(roles)
            if turn is None:
                break
            sampled = answer_ids(tok, messages, turn.answer, tools=case.tools, kwargs=kwargs)
            stopped = not turn.cut
            if turn.cut:
                sampled = sampled[:-1]
            ids = [*server, *sampled]
            whole.ids = [*whole.ids, *sampled]
            spans.append((len(server), len(ids), f"the answer of turn {index + 1}"))
            messages.append(turn.answer)
    except TemplateCannotExtend as exc:
        # The message the template drops or moves: the role to stop appending.
        lost = tok.unrendered(messages[-1], new, tools=case.tools, kwargs=kwargs)
        dropped = None if lost is None else str(new[lost]["role"])
        return CaseResult(
            case.name, Outcome.UNSUPPORTED, f"server: {exc.message}", case.role, (roles,), dropped
        )
    except InvalidRequest as exc:
        return CaseResult(
            case.name, Outcome.UNSUPPORTED, f"template: {exc.message}", case.role, (roles,)
        )
    except RolloutSessionError as exc:
        return CaseResult(case.name, Outcome.CORRUPT, f"server: {exc.message}", case.role, (roles,))
    except ValueError as exc:
        return CaseResult(
            case.name, Outcome.UNSUPPORTED, f"model output: {exc}", case.role, (roles,)
        )
    # In a history-dependent case, what the token-in/token-out prompts then
    # rewrite follows from them: only the history-dependence is named.
    shown = [
        why for outcome, why in notes if worst is not Outcome.HISTORY_DEPENDENT or outcome is worst
    ]
    return CaseResult(case.name, worst, "; ".join(shown), case.role, tuple(at), whole=whole.note)


def check_template(tok: ChatTokenizer, kwargs: Mapping[str, Any]) -> list[CaseResult]:
    """Every canonical case through each template the server would render
    it with (see the module docstring). The cases of a template served
    rendered whole say which turn would start a segment."""
    cases = canonical_cases(tok)
    if len(tok.templates) == 1:
        name = tok.templates[0].name
        results = [replace(run_case(tok, case, kwargs), template=name) for case in cases]
    else:
        plain, tooled = tok.templates
        results = [
            replace(run_case(tok, case, kwargs), template=plain.name)
            for case in cases
            if not case.tools
        ]
        # The tool template serves every request with tools, plain answers too.
        weather = [_WEATHER]
        results += [
            replace(run_case(tok, replace(case, tools=case.tools or weather), kwargs),
                    template=tooled.name)
            for case in cases
        ]  # fmt: skip
    whole = rendered_whole(results)
    return [_served_whole(r) if r.template in whole else r for r in results]


def _served_whole(result: CaseResult) -> CaseResult:
    """`result` of a template served rendered whole, its detail saying what
    that does to the case: where a turn starts a segment, or, for a
    history-dependent case, that none does."""
    if result.whole:
        note = result.whole
    elif result.outcome is Outcome.HISTORY_DEPENDENT:
        note = "every turn continues the session"
    else:
        return result
    return replace(
        result, detail="; ".join(filter(None, (result.detail, f"rendered whole, {note}")))
    )


def rendered_whole(results: Sequence[CaseResult]) -> dict[str | None, str]:
    """The templates to serve rendered whole (`TurnPolicy.rendered_whole`):
    each with a history-dependent case, and the line that says so, with its
    cost."""
    cases: dict[str | None, list[str]] = {}
    for r in results:
        if r.outcome is Outcome.HISTORY_DEPENDENT:
            cases.setdefault(r.template, []).append(r.name)
    return {
        name: (
            f"{'the chat template' if name is None else f'chat template {name!r}'} renders "
            f"appended messages from the history ({', '.join(names)}): it is served rendered "
            "whole, each later turn rendering the whole conversation (and tokenising it where "
            "the appended messages render otherwise after it), a cost that grows with the "
            "history (docs/templates.md#history-dependent-templates)"
        )
        for name, names in cases.items()
    }


def reachable(result: CaseResult, roles: Collection[str]) -> bool:
    """Whether a server appending `roles` in place meets the case's outcome."""
    return any(need <= frozenset(roles) for need in result.at)


def _label(result: CaseResult) -> str:
    if result.template is None:
        return result.name
    return f"{result.name} (template {result.template!r})"


def startup_problems(results: Sequence[CaseResult], append_roles: Collection[str]) -> list[str]:
    """Why the server must not start with this template and these settings:
    a corrupt junction, or one the server cannot take, that agents can reach
    (its appended roles are in `append_roles`, or the template renders them
    in place exactly: `in_place_roles`)."""
    roles = frozenset(append_roles) | in_place_roles(results)
    problems = []
    for r in results:
        if not reachable(r, roles):
            continue  # agents cannot send this case's junction
        if r.outcome is Outcome.CORRUPT:
            problems.append(f"{_label(r)}: {r.detail}")
        elif r.outcome is Outcome.UNSUPPORTED and r.detail.startswith("server:"):
            fix = f" (drop {r.dropped} from --append-roles)" if r.dropped else ""
            problems.append(f"{_label(r)}: {r.detail}{fix}")
    return problems


def role_fix(results: Sequence[CaseResult], append_roles: Collection[str]) -> frozenset[str] | None:
    """The largest set of `append_roles` with which the server would start
    (keeping ``user`` where it can), or None when no set would."""
    names = sorted(append_roles)
    subsets = [
        frozenset(subset)
        for size in range(len(names) - 1, 0, -1)
        for subset in itertools.combinations(names, size)
    ]
    subsets.sort(key=lambda s: (-len(s), "user" not in s, sorted(s)))
    return next((s for s in subsets if not startup_problems(results, s)), None)


def startup_refusal(results: Sequence[CaseResult], append_roles: Collection[str]) -> str | None:
    """Why the server would refuse to start, its first line naming the fix
    (None: it starts)."""
    problems = startup_problems(results, append_roles)
    if not problems:
        return None
    roles = role_fix(results, append_roles)
    if roles is not None:
        dropped = " or ".join(sorted(frozenset(append_roles) - roles))
        fix = (
            f"start with --append-roles {','.join(sorted(roles))} (an appended {dropped} "
            "message then starts a new segment), or serve another template with "
            "--chat-template FILE"
        )
    else:
        fix = (
            "serve a template the server can extend with --chat-template FILE "
            "(`rollout-session check-template --tokenizer DIR --chat-template FILE` checks one)"
        )
    return (
        "the chat template cannot be extended token-in/token-out exactly; "
        + fix
        + ":\n  - "
        + "\n  - ".join(problems)
    )


def in_place_roles(results: Sequence[CaseResult]) -> frozenset[str]:
    """Appended roles whose every case the template renders in place exactly:
    a session goes on through such a message instead of starting a segment."""
    roles = {r.role for r in results if r.role is not None}
    return frozenset(
        role for role in roles if all(r.outcome is Outcome.EXACT for r in results if r.role == role)
    )


def format_report(results: Sequence[CaseResult]) -> str:
    """One line per case; under a heading per template when they are named."""
    width = max(len(r.name) for r in results)
    names = list(dict.fromkeys(r.template for r in results))
    scopes = (
        {names[0]: "every request"}
        if len(names) == 1
        else {names[0]: "requests without tools", names[1]: "requests with tools"}
    )
    lines = []
    for name in names:
        indent = ""
        if name is not None:
            lines.append(f"chat template {name!r} ({scopes[name]}):")
            indent = "  "
        for r in results:
            if r.template != name:
                continue
            line = f"{indent}{r.name:<{width}}  {r.outcome.value}"
            if r.detail:
                line += f": {r.detail}"
            lines.append(line)
    return "\n".join(lines)
