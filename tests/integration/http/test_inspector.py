"""The trajectory inspector: `/ui` and its CSP, the re-render diff endpoint,
and the page itself driven in real headless Chromium (Playwright, the
system's Chromium; skipped only where no Chromium is installed, and never
when ROLLOUT_SESSION_REQUIRE_BROWSER is set, as in CI).

The browser runs in a worker thread (Playwright's sync API) while the
session server and its emulator keep serving on the test's trio loop; the
page talks to them over loopback. Screenshots go to ``artifacts/inspector``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import pytest
import trio

from rollout_session.emulator import EmulatorConfig
from rollout_session.http.routes.inspector import (
    CONTENT_SECURITY_POLICY,
    first_mismatch,
    is_public_path,
)
from tests import ROOT
from tests.conftest import OTHER_TOOLS, TOOLS, Stack, StackFactory
from tests.integration.session.test_turns import answered, echo
from tests.loopback import TLS

if TYPE_CHECKING:
    from playwright.sync_api import ConsoleMessage, Page

T = TypeVar("T")
KEY = "inspector-test-key"
SCRIPT = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
ARTIFACTS = ROOT / "artifacts" / "inspector"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def find_chromium() -> str | None:
    given = os.environ.get("ROLLOUT_SESSION_CHROMIUM")
    if given:
        return given
    return shutil.which("chromium") or shutil.which("chromium-browser")


async def tool_episode(stack: Stack, session_id: str, tool_result: str, turns: int = 3) -> None:
    """user → tool call → tool result (`tool_result`) → answer → user → …"""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "What does main.py print?"},
    ]
    for i in range(turns):
        response = await stack.chat(session_id, messages=messages, tools=TOOLS, seed=i)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        messages.append(echo(message))
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": f"And file {i}?"})
    assert any(m["role"] == "tool" for m in messages)


USER_1 = {"role": "user", "content": "What does main.py print?"}
USER_2 = {"role": "user", "content": "Never mind: what does test.py print?"}


async def segmented_episode(stack: Stack, session_id: str) -> dict[str, Any]:
    """Two segments and a retry: [user1] is answered, then [user1, user2]
    leaves that answer out (a new segment, ``answer_dropped`` at message 1),
    is sent again as if its answer was lost (a ``retry``), and extended once.
    Returns the export document."""
    first = [USER_1]
    assert (await stack.chat(session_id, messages=first, seed=1)).status_code == 200
    second = [USER_1, USER_2]
    for seed in (2, 3):  # the same request twice: the second one is a retry
        response = await stack.chat(session_id, messages=second, seed=seed)
        assert response.status_code == 200, response.text
    answer = echo(response.json()["choices"][0]["message"])
    third = [*second, answer, {"role": "user", "content": "Thanks."}]
    assert (await stack.chat(session_id, messages=third, seed=4)).status_code == 200
    doc = await stack.trajectory(session_id, schema=3)
    assert doc["num_segments"] == 2
    assert doc["segments"][1]["branch"] == {"reason": "answer_dropped", "segment": 0, "message": 1}
    assert [(r["reason"], r["segment"], r["turn"]) for r in doc["rollbacks"]] == [("retry", 1, 0)]
    return doc


async def think_episode(stack: Stack, session_id: str) -> None:
    """Two user turns against a reasoning model: the qwen3 template strips the
    first answer's <think> block from a re-render."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Think, then answer."}]
    first = await stack.chat(session_id, messages=messages, seed=1)
    messages += [
        *answered(first.json()["choices"][0]["message"]),
        {"role": "user", "content": "And?"},
    ]
    assert (await stack.chat(session_id, messages=messages, seed=2)).status_code == 200


async def weight_update_episode(stack: Stack, session_id: str) -> dict[str, Any]:
    """Two turns: the worker's weights go from v1 to v2 while turn 0 is
    being sampled (SGLang's ``/update_weight_version``, which aborts the
    request), so the server continues turn 0 and its tokens have two
    policies; turn 1 is sampled by v2 alone. Returns the export document."""
    emulator = stack.emulator
    assert emulator.weight_version == "v1"

    def midway() -> bool:
        return any(
            20 <= emulator.gpu.decoded(run.progress) < run.progress.total
            for run in emulator.weights.runs()
        )

    messages: list[dict[str, Any]] = [{"role": "user", "content": "Write a long answer."}]
    answers: list[httpx.Response] = []

    async def first_turn() -> None:
        answers.append(await stack.chat(session_id, messages=messages, seed=1))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first_turn)
        while not midway():  # noqa: ASYNC110 (decoding is timed: no event per token)
            await trio.sleep(0.005)
        # What the route does, called with no checkpoint between the check
        # and the update: the request is certainly still in flight.
        emulator.weights.sglang_update_weight_version("v2", abort_all=True)
    assert answers[0].status_code == 200, answers[0].text
    messages += [*answered(answers[0].json()["choices"][0]["message"]), USER_2]
    assert (await stack.chat(session_id, messages=messages, seed=2)).status_code == 200
    doc = await stack.trajectory(session_id)
    first, second = doc["turns"]
    assert [s["version"] for s in first["weight_versions"]] == ["v1", "v2"]
    assert first["weight_versions"][0]["start"] == first["completion_start"]
    assert first["weight_versions"][-1]["end"] == first["completion_end"]
    assert len(first["continuations"]) == 1
    assert [s["version"] for s in second["weight_versions"]] == ["v2"]
    assert second["continuations"] == []
    return doc


# --- the server side -------------------------------------------------------------------


def test_first_mismatch_compares_the_committed_length_only() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3, 4]) is None
    assert first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert first_mismatch([1, 2, 3], [1, 2]) == 2
    assert first_mismatch([], []) is None


async def test_page_is_public_with_strict_csp_and_data_needs_the_key(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(api_key=KEY)
    session_id = await stack.create()
    async with httpx.AsyncClient(base_url=stack.url, verify=TLS) as anonymous:
        for path, content_type in [
            ("/ui", "text/html"),
            ("/ui/", "text/html"),
            ("/ui/app.js", "text/javascript"),
            ("/ui/style.css", "text/css"),
        ]:
            response = await anonymous.get(path)
            assert response.status_code == 200, path
            assert response.headers["content-type"].startswith(content_type)
            assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert response.headers["x-content-type-options"] == "nosniff"
            assert is_public_path(path)
        page = (await anonymous.get("/ui")).text
        # No inline script or style anywhere in the page.
        assert "<style" not in page and " style=" not in page
        assert re.findall(r"<script[^>]*>", page) == ['<script type="module" src="/ui/app.js">']
        for path in (f"/sessions/{session_id}/diff", "/sessions", "/workers", "/ui/missing.js"):
            assert (await anonymous.get(path)).status_code == 401, path
        assert (await anonymous.post("/ui")).status_code == 401
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY
    assert (await stack.client.get("/ui/missing.js")).status_code == 404
    assert (await stack.client.post("/ui")).status_code == 405


async def test_diff_of_a_clean_chatml_session_has_no_mismatch(
    make_stack: StackFactory, hf_tokenizer: Any
) -> None:
    stack = await make_stack()
    await stack.create(session_id="clean")
    await tool_episode(stack, "clean", "print(1)")
    doc = await stack.trajectory("clean")
    diff = (await stack.client.get("/sessions/clean/diff")).json()
    assert diff["first_mismatch"] is None and diff["first_mismatch_turn"] is None
    assert diff["committed_ids"] == doc["token_ids"]
    assert diff["compared"] == len(doc["token_ids"]) and diff["num_turns"] == 3
    assert diff["rerendered_ids"][: diff["compared"]] == doc["token_ids"]
    # The committed ids end with the sampled <|im_end|>; the re-render adds "\n".
    assert hf_tokenizer.convert_ids_to_tokens(diff["tail"]) == ["Ċ"]
    assert diff["tail_expected"] is True
    assert len(diff["rerendered_pieces"]) == len(diff["rerendered_ids"])
    assert diff["committed_pieces"][-1] == "<|im_end|>"
    empty = await stack.create()
    diff = (await stack.client.get(f"/sessions/{empty}/diff")).json()
    assert diff["first_mismatch"] is None and diff["rerendered_ids"] == diff["tail"] == []
    assert (await stack.client.get("/sessions/nope/diff")).status_code == 404


async def test_diff_of_a_think_stripping_session_points_at_the_stripped_think(
    make_stack: StackFactory, hf_tokenizer: Any
) -> None:
    stack = await make_stack(template="qwen3", emulator=EmulatorConfig(reasoning=True))
    await stack.create(session_id="think")
    await think_episode(stack, "think")
    doc = await stack.trajectory("think")
    diff = (await stack.client.get("/sessions/think/diff")).json()
    think = hf_tokenizer.convert_tokens_to_ids("<think>")
    turn0 = doc["turns"][0]
    first_think = doc["token_ids"].index(think, turn0["completion_start"])
    assert diff["first_mismatch"] == first_think < turn0["completion_end"]
    assert diff["first_mismatch_turn"] == 0 and diff["first_mismatch_sampled"] is True
    assert diff["committed_pieces"][first_think] == "<think>"
    assert diff["tail"] == [] and diff["tail_expected"] is False


async def test_diff_of_each_segment_uses_that_segments_messages_and_tools(
    make_stack: StackFactory,
) -> None:
    """Segment 0 was rendered with TOOLS, segment 1 (tools changed) with
    OTHER_TOOLS: each diff is clean only if it re-renders its own segment."""
    stack = await make_stack()
    await stack.create(session_id="tools")
    first = await stack.chat("tools", messages=[USER_1], tools=TOOLS, seed=1)
    assert first.status_code == 200, first.text
    history = [USER_1, *answered(first.json()["choices"][0]["message"]), USER_2]
    second = await stack.chat("tools", messages=history, tools=OTHER_TOOLS, seed=2)
    assert second.status_code == 200, second.text
    doc = await stack.trajectory("tools", schema=3)
    assert doc["num_segments"] == 2
    assert doc["segments"][1]["branch"]["reason"] == "tools_changed"

    by_index = {}
    for query in ("?segment=0", "?segment=1", ""):
        response = await stack.client.get(f"/sessions/tools/diff{query}")
        assert response.status_code == 200, response.text
        by_index[query] = diff = response.json()
        assert diff["first_mismatch"] is None and diff["tail_expected"] is True, query
        assert diff["num_segments"] == 2
    assert by_index[""] == by_index["?segment=1"]
    zero, one = by_index["?segment=0"], by_index["?segment=1"]
    assert zero["segment"] == 0 and zero["branch"] is None
    assert zero["committed_ids"] == doc["segments"][0]["token_ids"]
    assert zero["num_turns"] == len(doc["segments"][0]["turns"]) == 1
    assert one["segment"] == 1 and one["branch"] == doc["segments"][1]["branch"]
    assert one["committed_ids"] == doc["segments"][1]["token_ids"]
    # Each re-render holds its own segment's tools only.
    zero_text, one_text = "".join(zero["rerendered_pieces"]), "".join(one["rerendered_pieces"])
    assert "Read a file" in zero_text and "Search the web" not in zero_text
    assert "Search the web" in one_text and "Read a file" not in one_text


@pytest.mark.parametrize(
    "raw",
    ["2", "-1", "x", "", "1.0", " 1", "+1", "0_1", "\u0661", "9" * 5000],
    ids=[
        "past-end",
        "negative",
        "word",
        "empty",
        "float",
        "space",
        "plus",
        "underscore",
        "arabic-digit",
        "huge",
    ],
)
async def test_diff_of_a_segment_that_does_not_exist_is_400(
    make_stack: StackFactory, raw: str
) -> None:
    stack = await make_stack()
    await stack.create(session_id="two")
    await segmented_episode(stack, "two")
    response = await stack.client.get("/sessions/two/diff", params={"segment": raw})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == "segment"
    assert "0 to 1" in error["message"]


# --- the page in headless Chromium ------------------------------------------------------


def _in_browser(chromium: str, script: Callable[[Page], T]) -> T:
    from playwright.sync_api import sync_playwright

    errors: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        # A 401 the page answers with its key dialog is logged as a failed load.
        # The test's own Trusted Types probe is reported too.
        expected = ("Failed to load resource", "requires 'TrustedHTML'")
        if message.type == "error" and not any(text in message.text for text in expected):
            errors.append(message.text)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(15_000)
            page.on("console", on_console)
            page.on("pageerror", lambda error: errors.append(str(error)))
            result = script(page)
        finally:
            browser.close()
    # CSP violations and uncaught exceptions: the page must run clean under its own CSP.
    assert errors == []
    return result


@pytest.fixture
def chromium() -> str:
    """The browser binary; skips only when none is installed (fails under
    ROLLOUT_SESSION_REQUIRE_BROWSER, so CI cannot silently skip)."""
    found = find_chromium()
    if found is None:
        if os.environ.get("ROLLOUT_SESSION_REQUIRE_BROWSER"):
            pytest.fail("ROLLOUT_SESSION_REQUIRE_BROWSER is set but no Chromium was found")
        pytest.skip(
            "Chromium not found: apt-get install chromium (or set ROLLOUT_SESSION_CHROMIUM)"
        )
    return found


async def browse(chromium: str, script: Callable[[Page], T]) -> T:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return await trio.to_thread.run_sync(_in_browser, chromium, script)


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"inspector-{name}.png"))


async def test_browser_overview_session_and_clean_diff_behind_an_api_key(
    make_stack: StackFactory, chromium: str
) -> None:
    stack = await make_stack(api_key=KEY)
    await stack.create(session_id="agent-tools", metadata={"task": "read main.py"})
    await tool_episode(stack, "agent-tools", SCRIPT)
    await stack.create(session_id="agent-chat")
    await tool_episode(stack, "agent-chat", "print(42)", turns=2)
    await stack.create(session_id="agent-new")
    doc = await stack.trajectory("agent-tools")
    sampled = sum(doc["loss_mask"])

    def script(page: Page) -> None:
        page.goto(f"{stack.url}/ui")
        # No key yet: the first data request answers 401 and the page asks once.
        page.wait_for_selector("#auth[open]")
        page.fill("#auth-key", KEY)
        page.press("#auth-key", "Enter")
        page.wait_for_selector("tr.session-row")
        page.wait_for_selector("#workers-body tr.worker-row")
        assert page.locator("tr.session-row").count() == 3
        assert "healthy" in page.inner_text("#workers-body")
        row = page.inner_text('tr.session-row[data-id="agent-tools"]')
        assert "open" in row and str(len(doc["token_ids"])) in row.replace(",", "")
        shot(page, "overview")

        # The overview refreshes by itself: a session created now shows up
        # without a reload (the marker set on this document survives).
        page.evaluate("window.__sameDocument = true")
        trio.from_thread.run(functools.partial(stack.create, session_id="agent-late"))
        page.wait_for_selector('tr.session-row[data-id="agent-late"]')
        assert page.evaluate("window.__sameDocument") is True

        page.click('a[href="#/s/agent-tools"]')
        page.wait_for_selector("#tokens .tok.sampled")
        assert page.locator("#tokens .tok.sampled").count() == sampled
        assert page.locator("#tokens .tok").count() == len(doc["token_ids"])
        assert page.locator(".turn-mark").count() == len(doc["turns"]) == 3
        assert page.locator("#messages .message").count() == len(doc["messages"])
        assert "finish tool_calls" in page.inner_text("#turn-0")
        # One segment, no rollback: a line, no segment table, no branch line.
        assert page.inner_text("#segments").startswith("One segment")
        assert page.locator("#segments-table, #branch").count() == 0
        assert "segment 0 of 1" in page.inner_text("#session-summary")
        assert "null" not in page.inner_text("#session-body")

        # A tool result holding markup is text: nothing ran, no element was made.
        assert page.evaluate("window.__pwned") is None
        assert page.locator("script").count() == 1 and page.locator("#view img").count() == 0
        assert SCRIPT in page.inner_text("#messages")
        # Trusted Types (from the CSP) make any HTML sink refuse a plain string.
        refused = page.evaluate(
            "() => { try { document.createElement('div').innerHTML = '<b>x</b>'; return 'ran'; }"
            " catch (error) { return error.name; } }"
        )
        assert refused == "TypeError"
        assert "<script>" in page.inner_text("#tokens")

        page.fill("#search", "read_file")
        page.press("#search", "Enter")
        assert page.inner_text("#search-status").startswith("1 / ")
        assert page.locator("#tokens .tok.hit").count() >= 2  # "read_file" spans tokens

        token = page.locator("#tokens .tok.sampled").nth(sampled // 2)
        token.hover()
        page.wait_for_selector("#tip:not([hidden])")
        i = int(token.get_attribute("data-i") or -1)
        tip = page.inner_text("#tip")
        assert f"#{i} · id {doc['token_ids'][i]}" in tip
        assert f"logprob {doc['logprobs'][i]:.4f}" in tip
        shot(page, "session")

        page.click("#tab-diff")
        page.wait_for_selector("#diff-summary")
        assert page.inner_text("#diff-summary").startswith("No mismatch.")
        assert "end of the last turn" in page.inner_text("#diff-summary")
        shot(page, "diff-clean")

        # The key lives in the tab's session storage: a reload does not ask again.
        page.reload()
        page.wait_for_selector("#diff-summary")
        assert page.locator("#auth[open]").count() == 0
        # Forgetting it asks again on the next data request.
        page.click("#forget-key")
        page.wait_for_selector("#auth[open]")
        page.fill("#auth-key", KEY)
        page.press("#auth-key", "Enter")
        page.wait_for_selector("#diff-summary")

    await browse(chromium, script)


async def test_browser_diff_shows_the_first_mismatch_of_a_think_stripping_template(
    make_stack: StackFactory, chromium: str
) -> None:
    stack = await make_stack(template="qwen3", emulator=EmulatorConfig(reasoning=True))
    await stack.create(session_id="think-strip")
    await think_episode(stack, "think-strip")
    diff = (await stack.client.get("/sessions/think-strip/diff")).json()
    at = diff["first_mismatch"]
    assert at is not None

    def script(page: Page) -> None:
        page.goto(f"{stack.url}/ui#/s/think-strip/diff")
        page.wait_for_selector("#diff-summary.bad")
        summary = page.inner_text("#diff-summary")
        assert f"First mismatch at token #{at}" in summary and "(turn 0" in summary
        mismatch = page.locator("tr.diff-row.mismatch")
        assert mismatch.count() == 1 and mismatch.get_attribute("data-i") == str(at)
        assert '"<think>"' in mismatch.inner_text()
        shot(page, "diff-mismatch")

    await browse(chromium, script)


async def test_browser_session_shows_every_segment_its_branch_point_and_rollbacks(
    make_stack: StackFactory, chromium: str
) -> None:
    stack = await make_stack(api_key=KEY)
    await stack.create(session_id="branchy")
    doc = await segmented_episode(stack, "branchy")
    first, last = doc["segments"]

    def sampled(segment: dict[str, Any]) -> int:
        return sum(segment["loss_mask"])

    def script(page: Page) -> None:
        page.goto(f"{stack.url}/ui")
        page.wait_for_selector("#auth[open]")
        page.fill("#auth-key", KEY)
        page.press("#auth-key", "Enter")
        row = page.locator('tr.session-row[data-id="branchy"]')
        row.wait_for()
        assert row.locator("td.segments").inner_text() == "2"
        assert row.locator("td.rollbacks").inner_text() == "1"

        # The session opens on its last segment; every segment is listed.
        page.click('a[href="#/s/branchy"]')
        page.wait_for_selector("#tokens .tok")
        rows = page.locator("#segments tr.segment-row")
        assert rows.count() == 2
        assert "start of the session" in rows.nth(0).inner_text()
        branch = rows.nth(1).inner_text()
        assert "answer_dropped" in branch and "segment 0 at message #1" in branch
        assert (
            page.locator("#segments tr.segment-row.selected").get_attribute("data-segment") == "1"
        )
        assert page.locator("#tokens .tok").count() == len(last["token_ids"])
        assert page.locator("#tokens .tok.sampled").count() == sampled(last)
        assert page.locator(".turn-mark").count() == len(last["turns"]) == 2
        assert page.locator("#messages .message").count() == len(last["messages"]) == 5
        assert "segment 1 of 2" in page.inner_text("#session-summary")
        assert "answer_dropped" in page.inner_text("#branch")
        # The first message that differs from segment 0 is marked.
        marked = page.locator("#messages .message.branch-point")
        assert marked.count() == 1 and "#1" in marked.inner_text()
        # The retry: the turn it replaced, listed and marked in the turn table.
        rollback = page.locator("#rollbacks tr.rollback-row")
        assert rollback.count() == 1
        text = rollback.inner_text()
        assert "retry" in text and "turn 0" in text and "segment 1" in text
        assert "retry" in page.inner_text("#turns tr.turn-row >> nth=0")
        shot(page, "segments")

        # Segment 0, whole: its own tokens, turns and messages.
        rows.nth(0).locator("a").click()
        page.wait_for_selector('#segments tr.segment-row.selected[data-segment="0"]')
        page.wait_for_selector("#tokens .tok")
        assert page.locator("#tokens .tok").count() == len(first["token_ids"])
        assert page.locator("#tokens .tok.sampled").count() == sampled(first)
        assert page.locator("#messages .message").count() == len(first["messages"]) == 2
        assert "segment 0 of 2" in page.inner_text("#session-summary")
        assert "start of the session" in page.inner_text("#branch")

        # Its diff: re-rendered from segment 0's own messages.
        page.click("#tab-diff")
        page.wait_for_selector("#diff-summary")
        assert page.inner_text("#diff-summary").startswith("No mismatch.")
        assert "segment 0 of 2" in page.inner_text("#diff-segment")
        assert page.locator("#diff-body tr.diff-row").count() > 0
        page.click('#diff-segments a[data-segment="1"]')
        page.wait_for_selector("#diff-segment >> text=segment 1 of 2")
        assert "answer_dropped" in page.inner_text("#diff-segment")
        shot(page, "diff-segments")

        # A segment the session does not have: the server's 400, shown.
        page.goto(f"{stack.url}/ui#/s/branchy/diff?segment=7")
        page.wait_for_selector("#load-error")
        assert "segment must be a segment index from 0 to 1" in page.inner_text("#load-error")
        page.goto(f"{stack.url}/ui#/s/branchy?segment=7")
        page.wait_for_selector("#load-error")
        assert "no segment 7" in page.inner_text("#load-error")

    await browse(chromium, script)


async def test_browser_shows_the_policy_versions_of_a_turn_a_weight_update_interrupted(
    make_stack: StackFactory, chromium: str
) -> None:
    """The turn table's policy column ("v1 → v2", "1 continuation", each with
    its tooltip), the mark in the stream where v2 starts, the version in a
    sampled token's tooltip, and the legend's entry for the mark."""
    stack = await make_stack(
        engine="sglang-generate",  # an engine that continues the aborted turn
        emulator=EmulatorConfig(
            weight_version="v1", completion_tokens=200, decode_s_per_token=0.005
        ),
    )
    await stack.create(session_id="updated")
    doc = await weight_update_episode(stack, "updated")
    turn = doc["turns"][0]
    old, new = turn["weight_versions"]
    (continuation,) = turn["continuations"]
    reprefilled = continuation["prompt_tokens"] - (continuation["cached_tokens"] or 0)

    def script(page: Page) -> None:
        page.goto(f"{stack.url}/ui#/s/updated")
        page.wait_for_selector("#tokens .tok")
        headers = page.locator("#turns th").all_inner_texts()
        assert "policy" in headers
        rows = page.locator("#turns tr.turn-row")
        assert rows.count() == 2
        policy = rows.nth(0).locator("td.policy")
        version = policy.locator(".badge.version")
        assert version.inner_text() == "v1 → v2"
        assert "changed" in (version.get_attribute("class") or "")
        spans = version.get_attribute("title") or ""
        for span in (old, new):
            count = span["end"] - span["start"]
            assert f"#{span['start']}–{span['end']} ({count} tokens): {span['version']}" in spans
        continued = policy.locator(".badge.continued")
        assert continued.inner_text() == "1 continuation"
        detail = continued.get_attribute("title") or ""
        assert continuation["worker"] in detail and f"{reprefilled} re-prefilled" in detail
        assert f"{continuation['discarded_tokens']} discarded" in detail
        # An ordinary turn: one version, no continuation.
        plain = rows.nth(1).locator("td.policy")
        assert plain.inner_text() == "v2" and plain.locator(".badge.continued").count() == 0
        assert "weights v1 → v2 · 1 continuation" in page.inner_text("#turn-0")

        # One mark, right before the first token v2 sampled.
        marks = page.locator("#tokens .version-mark")
        assert marks.count() == 1
        mark = marks.first
        assert mark.inner_text() == "→ v2"
        assert mark.get_attribute("data-start") == str(new["start"])
        assert mark.evaluate("el => el.nextElementSibling.dataset.i") == str(new["start"])
        assert "v1" in (mark.get_attribute("title") or "")
        # Sampled tokens name their policy in the tooltip.
        for span, text in ((old, "policy v1 (span 1 of 2)"), (new, "policy v2 (span 2 of 2)")):
            page.locator(f'#tokens .tok[data-i="{span["end"] - 1}"]').hover()
            page.wait_for_selector("#tip:not([hidden])")
            assert text in page.inner_text("#tip")
        page.locator(f'#tokens .tok[data-i="{doc["turns"][1]["completion_start"]}"]').hover()
        tip = page.inner_text("#tip")
        assert "policy v2\n" in tip and "(span" not in tip
        assert "policy changed mid-turn" in page.inner_text("#legend-version")
        mark.scroll_into_view_if_needed()
        shot(page, "policy")

    await browse(chromium, script)


async def test_browser_long_trajectory_renders_lazily(
    make_stack: StackFactory, chromium: str
) -> None:
    stack = await make_stack(emulator=EmulatorConfig(completion_tokens=16_000))
    await stack.create(session_id="long")
    words = " ".join(f"w{i}" for i in range(6_000))
    response = await stack.chat("long", messages=[{"role": "user", "content": words}])
    assert response.status_code == 200, response.text
    n = len((await stack.trajectory("long"))["token_ids"])
    assert n > 30_000

    def script(page: Page) -> None:
        page.goto(f"{stack.url}/ui#/s/long")
        page.wait_for_selector("#tokens .tok")
        initial = page.locator("#tokens .tok").count()
        # One chunk (tokens.js CHUNK) of a >30k-token trajectory is drawn at first.
        assert 0 < initial <= 2_000 < n
        # Scrolling the stream draws the next chunk.
        page.locator("#tokens").evaluate("el => { el.scrollTop = el.scrollHeight; }")
        page.wait_for_selector(f'#tokens .tok[data-i="{initial}"]', state="attached")
        # A search for a far position draws up to it and centres it.
        page.fill("#search", f"#{n - 5}")
        page.press("#search", "Enter")
        page.wait_for_selector(f'.tok.current[data-i="{n - 5}"]')
        assert page.locator("#tokens .tok").count() <= n

    await browse(chromium, script)


async def test_browser_overview_with_the_trainer_key_when_an_operator_key_is_set(
    make_stack: StackFactory, chromium: str
) -> None:
    """The pool is the operator's: the trainer's key gets the sessions and a
    note where the workers would be, not a failed overview."""
    stack = await make_stack(api_key=KEY, admin_api_key="operator-key")
    await stack.create(session_id="agent-chat")

    def script(page: Page) -> None:
        page.goto(f"{stack.url}/ui")
        page.wait_for_selector("#auth[open]")
        page.fill("#auth-key", KEY)
        page.press("#auth-key", "Enter")
        page.wait_for_selector('tr.session-row[data-id="agent-chat"]')
        assert "needs the operator key" in page.inner_text("#workers-body")
        assert "refresh failed" not in page.inner_text("#updated")

    await browse(chromium, script)
