"""The README's server command, run as a new user would: `serve --demo`."""

from __future__ import annotations

import os
import signal
import sys

import httpx
import openai
import trio

from rollout_session.testing.processes import start_listening


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
        url, process = await start_listening(nursery, command, env=env)
        async with httpx.AsyncClient(base_url=url) as client:
            created = (await client.post("/sessions")).json()
            content = await trio.to_thread.run_sync(agent_turn, url + created["base_url"])
            assert content
            closed = (await client.delete(f"/sessions/{created['session_id']}")).json()
        assert closed["status"] == "closed" and len(closed["turns"]) == 1
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            assert await process.wait() == 0
