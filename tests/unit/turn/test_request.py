"""Request parsing: what an agent may set."""

from __future__ import annotations

import orjson
import pytest

from rollout_session.errors import InvalidRequest
from rollout_session.turn.request import parse_chat_request

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "kwargs",
    [{"chat_template": "{{ 1 }}"}, {"tools": []}, {"add_generation_prompt": False},
     {"raise_exception": "x"}, {"strftime_now": "2020-01-01"}],
    ids=["chat_template", "tools", "add_generation_prompt", "raise_exception", "strftime_now"],
)  # fmt: skip
def test_template_kwargs_may_not_replace_the_servers_arguments(kwargs: dict[str, object]) -> None:
    body = orjson.dumps({"messages": USER, "chat_template_kwargs": kwargs})
    with pytest.raises(InvalidRequest, match="chat_template_kwargs may not set") as caught:
        parse_chat_request(body)
    assert caught.value.param == "chat_template_kwargs"


def test_template_kwargs_of_a_template_pass() -> None:
    body = orjson.dumps({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert parse_chat_request(body).chat_template_kwargs == {"enable_thinking": False}
