"""The README's server command, run as a new user would: `serve --demo`."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import httpx
import openai
import trio


async def read_url(process: trio.Process) -> str:
    """The demo prints its URL once it is accepting connections."""
    assert process.stdout is not None
    buffer = b""
    async for chunk in process.stdout:
        buffer += chunk
        for line in buffer.decode().splitlines():
            if line.startswith("rollout-session listening on "):
                return line.rsplit(" ", 1)[1]
    raise AssertionError(f"server exited before listening; output: {buffer.decode()}")


def agent_turn(base_url: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "hello"}]
    )
    client.close()
    return answer.choices[0].message.content or ""


async def test_serve_demo_runs_a_session_and_stops_on_sigint() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "rollout_session", "serve", "--demo", "--port", "0"]
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            functools.partial(
                trio.run_process, command, stdout=subprocess.PIPE, check=False, env=env
            )
        )
        with trio.fail_after(60):
            url = await read_url(process)
        async with httpx.AsyncClient(base_url=url) as client:
            created = (await client.post("/sessions")).json()
            content = await trio.to_thread.run_sync(agent_turn, url + created["base_url"])
            assert content
            closed = (await client.delete(f"/sessions/{created['session_id']}")).json()
        assert closed["status"] == "closed" and len(closed["turns"]) == 1
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await process.wait() == 0
