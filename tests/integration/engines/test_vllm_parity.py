"""The ``vllm`` engine gives what ``sglang-chat`` gives, family by family.

Each family's episodes (the families suite's patterns) run through
``sglang-chat`` against an SGLang emulator and through ``vllm`` against a
vLLM emulator launched with the family's vLLM parsers, both with the same
seed. The emulator samples from the prompt ids alone, so the trajectories
(ids, logprobs, masks), the finish reasons and what the agent sees
(content, reasoning, tool calls) must be identical. GLM's parser has vLLM
constrain every tool request with a structural tag: those turns take it
from the worker's ``/v1/chat/completions/render``. Where the ``vllm``
engine refuses a family's parsers (start-up), the test asserts the refusal.
"""

from __future__ import annotations

import pytest
import trio

from rollout_session import Settings, create_app
from rollout_session.emulator import EmulatorConfig
from rollout_session.engines.vllm.parsers import VllmParsers
from rollout_session.http.serving import RunningServer, start_server
from rollout_session.prompt.check import Outcome
from tests.conftest import spawn_worker
from tests.families import (
    FAMILIES,
    family_facts,
    family_path,
    family_text_model,
    family_tokenizer,
    sglang_parsers,
)
from tests.integration.engines.test_generate_parity import _run, _shape
from tests.integration.session.test_families import PATTERNS
from tests.loopback import TLS
from tests.unit.prompt.test_check import CASES, REPORT


def _parsers(family: str) -> tuple[str | None, str | None]:
    facts = family_facts(family)
    return facts["vllm_tool_call_parser"], facts["vllm_reasoning_parser"]


def _supported(family: str) -> bool:
    try:
        VllmParsers(*_parsers(family))
    except ValueError:
        return False
    return True


SERVED = [f for f in FAMILIES if _supported(f)]
REFUSED = [f for f in FAMILIES if not _supported(f)]


def _tools_served(family: str) -> bool:
    """With no tool parser on the worker, vLLM refuses tool requests."""
    return _parsers(family)[0] is not None


async def _servers(nursery: trio.Nursery, family: str) -> tuple[RunningServer, RunningServer]:
    path = family_path(family)
    model = family_text_model(family)
    tool_call, reasoning = _parsers(family)
    sglang = await spawn_worker(
        nursery,
        model,
        EmulatorConfig(tokenizer_path=path, reasoning=True, **sglang_parsers(family)),
    )
    vllm = await spawn_worker(
        nursery,
        model,
        EmulatorConfig(
            tokenizer_path=path,
            reasoning=True,
            engine="vllm",
            enable_scale_out=True,
            tool_call_parser=tool_call,
            reasoning_parser=reasoning,
        ),
    )
    settings = [
        Settings(workers=(sglang.url,), port=0, tokenizer=str(path), engine="sglang-chat"),
        Settings(
            workers=(vllm.url,),
            port=0,
            tokenizer=str(path),
            engine="vllm",
            tool_call_parser=tool_call,
            reasoning_parser=reasoning,
        ),
    ]
    servers = []
    for each in settings:
        servers.append(
            await start_server(
                nursery, create_app(each, tokenizer=family_tokenizer(family), worker_tls=TLS)
            )
        )
    return servers[0], servers[1]


@pytest.mark.parametrize("family", SERVED)
async def test_vllm_engine_matches_sglang_chat(nursery: trio.Nursery, family: str) -> None:
    chat, vllm = await _servers(nursery, family)
    outcomes = dict(zip(CASES, REPORT[family], strict=True))
    patterns = [p for p in PATTERNS if outcomes[p] is not Outcome.UNSUPPORTED]
    if not _tools_served(family):
        patterns = [p for p in patterns if "tool" not in p]
    try:
        for pattern in patterns:
            chat_doc, chat_answers = await _run(chat, family, pattern)
            doc, answers = await _run(vllm, family, pattern)
            for key in ("token_ids", "logprobs", "loss_mask"):
                assert doc[key] == chat_doc[key], (pattern, key)
            assert [t["finish_reason"] for t in doc["turns"]] == [
                t["finish_reason"] for t in chat_doc["turns"]
            ], pattern
            assert _shape(answers) == _shape(chat_answers), pattern
    finally:
        await chat.aclose()
        await vllm.aclose()


@pytest.mark.parametrize("family", REFUSED)
def test_parsers_the_vllm_engine_cannot_reproduce_are_refused_at_startup(family: str) -> None:
    tool_call, reasoning = _parsers(family)
    with pytest.raises(ValueError, match="--engine vllm does not support"):
        Settings(
            workers=("http://127.0.0.1:1",),
            engine="vllm",
            tool_call_parser=tool_call,
            reasoning_parser=reasoning,
        )
