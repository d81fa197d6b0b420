"""The snippets of docs/agents.md, run as written: each `<!-- snippet: NAME -->`
block, after the `connect` one, against `serve --demo`, with every model call
any HTTP client of the process made recorded (`Recorder.every_client`) and
checked against the export (`check_episode`): the doc and the tested code are
one text, so they cannot drift apart.

The demo's address replaces the doc's `http://127.0.0.1:8000`; `model` is
the served model, as the doc says. The shell snippets (Claude Code) run under
bash with `SERVER`, `SESSION_ID`, `API_KEY` and `MODEL` set, and `claude`
from `.frameworks-node/` (scripts/test-frameworks) or the PATH.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import tempfile
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.frameworks.harness import (
    DemoServer,
    Episode,
    Recorder,
    check_episode,
    close_thread_loop,
    demo_server,
)

_DOC = Path(__file__).parents[2] / "docs" / "agents.md"
_DOC_URL = "http://127.0.0.1:8000"
_SNIPPET = re.compile(r"<!-- snippet: ([\w-]+) -->\n```(\w+)\n(.*?)\n```", re.DOTALL)
# Where scripts/test-frameworks installs Claude Code (npm, a local prefix).
_CLAUDE = Path(__file__).parents[2] / ".frameworks-node" / "node_modules" / ".bin" / "claude"


def snippets() -> dict[str, tuple[str, str]]:
    """Every marked snippet of docs/agents.md: name → (language, code)."""
    found = {m[1]: (m[2], m[3]) for m in _SNIPPET.finditer(_DOC.read_text())}
    assert found, f"no snippets in {_DOC}"
    return found


@pytest.fixture(scope="module")
def server() -> Iterator[DemoServer]:
    with demo_server("--auto-create-sessions") as running:
        yield running


def _served_model(server: DemoServer) -> str:
    return str(httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"])


def _run(server: DemoServer, name: str) -> tuple[str, Recorder]:
    """The `connect` snippet, then `name`'s, in one namespace: the session
    its calls went to, and what they received."""
    code = snippets()
    namespace: dict[str, Any] = {"model": _served_model(server)}
    recorder = Recorder()
    try:
        with recorder.every_client():
            for part in ("connect", name):
                language, text = code[part]
                assert language == "python", part
                source = text.replace(_DOC_URL, server.url)
                exec(compile(source, f"agents.md:{part}", "exec"), namespace)
        return str(namespace["rollout" if name == "verifiers" else "session_id"]), recorder
    finally:
        close_thread_loop()
        _drop(namespace)


def _drop(namespace: dict[str, Any]) -> None:
    """A snippet is short, as a user's script is: it leaves its clients
    open. Collect them now, quietly, rather than have a later test (or the
    session's end) report their sockets."""
    namespace.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


# The Python snippets, and the protocols their model calls speak.
PROTOCOLS = {
    "openai-chat": {"chat"},
    "openai-responses": {"responses"},
    "openai-agents": {"responses"},
    "litellm": {"chat"},
    "litellm-anthropic": {"messages"},
    "langchain": {"chat", "responses"},
    "pydantic-ai": {"chat", "responses"},
    "anthropic": {"messages"},
    "one-base-url": {"chat"},
    "verifiers": {"chat"},
}
PYTHON = list(PROTOCOLS)
_ONE_CALL = {"one-base-url", "anthropic", "litellm-anthropic"}
# The shell snippets: Claude Code at a session, and at the root.
CLAUDE_CODE = ["claude-code", "claude-code-root"]


def test_every_snippet_is_run() -> None:
    assert set(snippets()) == {"connect", *CLAUDE_CODE, *PYTHON}


@pytest.mark.parametrize("name", PYTHON, ids=PYTHON)
def test_a_snippet_as_written(server: DemoServer, episodes: list[Episode], name: str) -> None:
    if name == "verifiers":
        # scripts/test-frameworks runs it in .venv-verifiers (pyproject's
        # frameworks-verifiers): its pins exclude openai-agents'.
        pytest.importorskip("verifiers", reason="verifiers runs in .venv-verifiers")
    session_id, recorder = _run(server, name)
    calls = recorder.take()
    doc = server.close_session(session_id)
    assert calls and all(c.status == 200 for c in calls), [c.response for c in calls]
    assert {c.protocol for c in calls} == PROTOCOLS[name]
    episode = check_episode(f"agents.md {name}", calls, doc)
    episodes.append(episode)
    assert episode.ok_calls >= 2 or name in _ONE_CALL, episode
    # verifiers': the session its first request created, named by the header.
    assert doc["session_id"] == session_id


@pytest.mark.parametrize("name", CLAUDE_CODE, ids=CLAUDE_CODE)
def test_claude_code(server: DemoServer, episodes: list[Episode], name: str) -> None:
    """`claude -p` (print mode) at a session, or at the root naming it by a
    header (the session created by its first request): its turns reach the
    trajectory. Claude Code is a native program, so no hook sees its calls:
    its own JSON report (`--output-format json`: the answer, the number of
    turns, the output tokens) is checked against the export."""
    claude = str(_CLAUDE) if _CLAUDE.exists() else shutil.which("claude")
    if claude is None:
        pytest.skip("claude is not installed (scripts/test-frameworks installs it with npm)")
    if name == "claude-code":
        session_id, _ = server.create_session({"framework": "claude-code"})
    else:
        session_id = f"claude-code-{uuid.uuid4().hex}"
    _, command = snippets()[name]
    with tempfile.TemporaryDirectory(prefix="rollout-claude-") as home:
        env = {
            "PATH": f"{Path(claude).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": home,  # its settings and history: none of the user's
            "SERVER": server.url,
            "SESSION_ID": session_id,
            "API_KEY": "unused",
            "MODEL": _served_model(server),
        }
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=home,
            env=env,
            capture_output=True,
            timeout=300,
            check=False,
        )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], server.log_tail())
    report = json.loads(done.stdout)
    doc = server.close_session(session_id)
    assert doc["session_id"] == session_id
    turns = [t for s in doc["segments"] for t in s["turns"]]
    sampled = sum(sum(s["loss_mask"]) for s in doc["segments"])
    assert not report["is_error"], report
    assert turns and len(turns) >= report["num_turns"], (report, len(turns))
    assert sampled == report["usage"]["output_tokens"], (report["usage"], sampled)
    pieces = "".join(p for s in doc["segments"] for p in s["pieces"])
    assert report["result"].strip() in pieces, report["result"]
    episodes.append(
        Episode(
            name,
            calls=len(turns),
            ok_calls=len(turns),
            retries=0,
            turns=len(turns),
            segments=doc["num_segments"],
            reasons=Counter(s["branch"]["reason"] for s in doc["segments"] if s["branch"]),
            rollbacks=Counter(r["reason"] for r in doc["rollbacks"]),
        )
    )
