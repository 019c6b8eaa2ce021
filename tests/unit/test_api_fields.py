"""The OpenAI endpoints' field contract (api/fields.py) as a table: every field in one
list only, and each list doing what it says."""

from __future__ import annotations

from typing import Any

import pytest

from meshnet.api.fields import HONOURED, MEANINGLESS, REFUSED, check_fields
from meshnet.errors import UnsupportedField


@pytest.mark.parametrize("endpoint", ["chat", "text"])
def test_each_field_is_in_one_list_only(endpoint: Any) -> None:
    honoured = HONOURED[endpoint]
    assert not honoured & MEANINGLESS
    assert not honoured & set(REFUSED)
    assert not MEANINGLESS & set(REFUSED)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [], "user": "u", "metadata": {}, "store": True},
        {"model": "m", "response_format": {"type": "text"}, "modalities": ["text"]},
        {"model": "m", "tools": None, "reasoning_effort": None},  # null asks for nothing
        {"messages": [{"role": "assistant", "content": "x", "refusal": None}]},
    ],
)
def test_what_asks_for_nothing_passes(body: dict[str, Any]) -> None:
    check_fields("chat", body)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("text", {"model": "m", "tools": []}, "tools"),  # chat only
        ("text", {"reasoning_effort": "low"}, "reasoning_effort"),  # chat only
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"echo": True}, "echo"),  # completions only
        ("chat", {"temprature": 0.2}, "temprature"),
        ("text", {"suffix": "x"}, "suffix"),
        ("text", {"top_logprobs": 2}, "top_logprobs"),  # chat only
        ("chat", {"messages": [{"role": "user", "content": "x", "name": "a"}]}, "messages.0.name"),
    ],
)
def test_a_refused_or_unknown_field_is_named(
    endpoint: Any, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(UnsupportedField) as e:
        check_fields(endpoint, body)
    assert e.value.param == param and e.value.http_status == 400
    assert e.value.kind == "unsupported-parameter"
