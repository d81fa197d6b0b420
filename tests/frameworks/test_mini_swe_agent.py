"""mini-swe-agent (through LiteLLM) against `serve --demo`.

What mini-swe-agent does to the history: an answer it cannot parse (no
tool call for the tool-calling model, no ```mswea_bash_command block for the
text-based one) is *not* added to its messages; a user message with the
format error is appended instead, and the model is asked again. So the next
request drops the model's answer: a new segment (`answer_dropped`) that
keeps the rejected sample. After `max_consecutive_format_errors` in a row
the episode ends.

The model's commands are never run: the environment below answers every
command with a canned observation and submits after a few of them.

Each episode runs under every engine (`--engine sglang-chat`,
`sglang-generate` and `vllm`): the same answers and the same trajectory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import litellm
import pytest
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.exceptions import Submitted
from minisweagent.models.litellm_model import LitellmModel
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

from tests.frameworks.harness import (
    DemoServer,
    Episode,
    ModelCall,
    Recorder,
    check_episode,
    check_same_across_engines,
    close_thread_loop,
    demo_servers,
    dump,
)
from tests.loopback import TLS


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, DemoServer]]:
    with demo_servers("--demo-reasoning", "--chat-template", "qwen3") as running:
        yield running


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    """LiteLLM's OpenAI provider takes its HTTP client from
    `litellm.client_session`: the hook sees every answer LiteLLM received."""
    recorder = Recorder()
    with httpx.Client(event_hooks={"response": [recorder.sync_hook]}, verify=TLS) as http:
        before = litellm.client_session
        litellm.client_session = http
        try:
            yield recorder
        finally:
            litellm.client_session = before
            close_thread_loop()


class CannedEnvironment:
    """An environment that runs nothing: each command gets a listing-like
    output, and the `submit_after`-th command submits."""

    def __init__(self, submit_after: int) -> None:
        self.config: dict[str, Any] = {}
        self.submit_after = submit_after
        self.commands: list[str] = []

    def execute(self, action: dict[str, Any], cwd: str = "", **_: Any) -> dict[str, Any]:
        self.commands.append(str(action.get("command", "")))
        if len(self.commands) >= self.submit_after:
            raise Submitted(
                {
                    "role": "exit",
                    "content": "diff --git a/x.py b/x.py",
                    "extra": {"exit_status": "Submitted", "submission": "diff --git a/x.py"},
                }
            )
        output = f"x.py\ny{len(self.commands)}.py\n"
        return {"output": output, "returncode": 0, "exception_info": ""}

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {"system": "Linux", "release": "6.1", "version": "#1", "machine": "x86_64", **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {}


# (model class, its config file, commands before the canned submit)
EPISODES: list[tuple[type[Any], str, int]] = [
    (LitellmModel, "mini.yaml", 2),
    (LitellmModel, "mini.yaml", 4),
    (LitellmTextbasedModel, "default.yaml", 2),
]


def _checked_episode(
    server: DemoServer,
    recorder: Recorder,
    engine: str,
    model_class: type[Any],
    config: str,
    submit_after: int,
) -> tuple[list[ModelCall], dict[str, Any], Episode]:
    session_id, base_url = server.create_session({"framework": "mini-swe-agent", "engine": engine})
    # The packaged config, as `mini -c CONFIG` reads it: the agent's prompts
    # and the model's observation and format-error templates.
    spec: dict[str, Any] = get_config_from_spec(config)
    model_config = spec.get("model", {})
    model = model_class(
        **{
            **model_config,
            "model_name": "openai/rollout-session/emulator",
            "model_kwargs": {
                **model_config.get("model_kwargs", {}),
                "api_base": base_url,
                "api_key": "unused",
            },
            "cost_tracking": "ignore_errors",
        }
    )
    environment = CannedEnvironment(submit_after)
    agent = DefaultAgent(model, environment, **{**spec["agent"], "step_limit": 12})
    result = agent.run("The function in x.py returns the wrong value.")
    doc = server.close_session(session_id)
    calls = recorder.take()
    dump(f"mini-swe-agent-{engine}", calls, doc)
    assert all(c.status == 200 for c in calls), [c.response for c in calls if c.status != 200]
    episode = check_episode(f"mini-swe-agent ({engine})", calls, doc)
    assert result["exit_status"] in ("Submitted", "RepeatedFormatError"), result
    # Every call that came back without a usable action was dropped from the
    # history: each such answer is the last turn of a segment.
    assert episode.reasons["answer_dropped"] >= 1, server.log_tail()
    return calls, doc, episode


@pytest.mark.parametrize(
    ("model_class", "config", "submit_after"),
    EPISODES,
    ids=["toolcall-short", "toolcall-long", "textbased"],
)
def test_every_sampled_token_is_exported(
    servers: dict[str, DemoServer],
    recorder: Recorder,
    episodes: list[Episode],
    model_class: type[Any],
    config: str,
    submit_after: int,
) -> None:
    runs: dict[str, tuple[list[ModelCall], dict[str, Any]]] = {}
    for engine, server in servers.items():
        calls, doc, episode = _checked_episode(
            server, recorder, engine, model_class, config, submit_after
        )
        episodes.append(episode)
        runs[engine] = calls, doc
    label = f"mini-swe-agent ({model_class.__name__}, {submit_after} commands)"
    assert check_same_across_engines(label, runs) >= 1
