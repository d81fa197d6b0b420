"""`trainers.example_agent`: the prompt of a trainer's row, and its tool."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_session.trainers.example_agent import prompt_messages, read_file

HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("key", ["raw_prompt", "prompt", "messages"], ids=str)
def test_the_prompt_of_each_trainers_row(key: str) -> None:
    messages = prompt_messages({key: HELLO, "extra_info": {}})
    assert messages == HELLO and messages[0] is not HELLO[0]  # a copy the agent may extend


@pytest.mark.parametrize(
    "row", [{}, {"prompt": []}, {"prompt": "hello"}], ids=["none", "empty", "text"]
)
def test_a_row_without_messages_is_refused(row: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="no prompt messages"):
        prompt_messages(row)


def test_the_tool_reads_its_arguments() -> None:
    assert read_file('{"path": "a.txt"}') == "contents of a.txt"
    assert read_file("not json").startswith("error:")
