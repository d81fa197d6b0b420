"""`sglang-generate` gives what `sglang-chat` gives, family by family.

Each family's episode (the families suite's: plain, tool call, parallel
tool calls, cut by max_tokens; reasoning where the family shows it) runs
once through each engine, against emulator workers with the same seed.
The emulator samples from the prompt ids alone, on either route, so the
trajectories (ids, logprobs, masks) and the agent's answers (content,
reasoning, tool calls, finish reasons) must be identical; tool-call ids are
fresh per call on both routes and compared by shape only.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import pytest
import trio
from transformers import AutoTokenizer

from rollout_session import Settings, create_app
from rollout_session.http.serving import start_server
from rollout_session.testing import EmulatorConfig, TextModel
from tests.conftest import spawn_worker
from tests.families import FAMILIES, family_facts, family_path, family_tokenizer, template_text
from tests.integration.session.test_families import CLOCK, PATTERNS, WEATHER, _episode
from tests.unit.prompt.test_check import CASES, REPORT, Outcome

_CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


async def _run(
    nursery: trio.Nursery, family: str, engine: str, pattern: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    path = family_path(family)
    model = TextModel(AutoTokenizer.from_pretrained(str(path)))
    worker = await spawn_worker(nursery, model, EmulatorConfig(tokenizer_path=path, reasoning=True))
    facts = family_facts(family)
    parsers = (
        {
            "tool_call_parser": facts.get("sglang_tool_call_parser"),
            "reasoning_parser": facts.get("sglang_reasoning_parser"),
        }
        if engine == "sglang-generate"
        else {}
    )
    settings = Settings(
        workers=(worker.url,), port=0, tokenizer=str(path), engine=engine, **parsers
    )
    server = await start_server(nursery, create_app(settings, tokenizer=family_tokenizer(family)))
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as trainer:
            sid = (await trainer.post("/sessions", json={})).json()["session_id"]
            agent = openai.AsyncOpenAI(
                base_url=f"{server.url}/sessions/{sid}/v1", api_key="unused", max_retries=0
            )
            lists_tools = "tools" in template_text(family)
            if pattern == "plain":
                episode = await _episode(agent, tools=None)
            elif pattern == "tool call":
                episode = await _episode(agent, tools=[WEATHER], lists_tools=lists_tools)
            elif pattern == "parallel tool calls":
                episode = await _episode(
                    agent, tools=[WEATHER, CLOCK], parallel=True, lists_tools=lists_tools
                )
            else:
                episode = await _episode(agent, tools=None, cut_at=1)
            await agent.close()
            doc = (await trainer.get(f"/sessions/{sid}/trajectory")).json()
    finally:
        await server.aclose()
    return doc, [t.answer for t in episode.turns]


def _shape(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for answer in answers:
        calls = answer.get("tool_calls") or []
        for call in calls:
            assert _CALL_ID.match(call["id"]) or call["id"].startswith("functions."), call
        out.append(
            {
                "content": answer.get("content") or "",
                "reasoning": answer.get("reasoning_content"),
                "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
            }
        )
    return out


CASES_RUN = [
    (family, pattern)
    for family in FAMILIES
    for pattern in PATTERNS
    if dict(zip(CASES, REPORT[family], strict=True))[pattern] is not Outcome.UNSUPPORTED
]


@pytest.mark.parametrize(("family", "pattern"), CASES_RUN, ids=[f"{f}-{p}" for f, p in CASES_RUN])
async def test_generate_engine_matches_chat_engine(
    nursery: trio.Nursery, family: str, pattern: str
) -> None:
    chat_doc, chat_answers = await _run(nursery, family, "sglang-chat", pattern)
    gen_doc, gen_answers = await _run(nursery, family, "sglang-generate", pattern)
    for key in ("token_ids", "logprobs", "loss_mask"):
        assert gen_doc[key] == chat_doc[key], key
    assert [t["finish_reason"] for t in gen_doc["turns"]] == [
        t["finish_reason"] for t in chat_doc["turns"]
    ]
    assert _shape(gen_answers) == _shape(chat_answers)
