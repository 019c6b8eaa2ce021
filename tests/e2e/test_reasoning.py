"""Reasoning returned apart, on a tiny random model whose template opens ``<think>``.

The template is ChatML whose generation prompt opens the reasoning part, as
DeepSeek-R1's does: everything the model writes until ``</think>`` is
``reasoning_content``. A random model never closes it, so all it writes is
reasoning, streamed as ``delta.reasoning_content`` and equal to the whole reply's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from conftest import MeshFactory
from tiny_requests import openai_client
from tinymodel import CHATML

from meshnet.local_mesh import LocalMesh

R1_STYLE = (
    CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    + "{# a reply's reasoning ends at </think> #}"
)
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def thinking_tiny(tiny_factory: Any) -> Path:
    assert "assistant\n<think>" in R1_STYLE
    return Path(tiny_factory("think.gguf", context_length=512, chat_template=R1_STYLE))


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, thinking_tiny: Path) -> LocalMesh:
    return mesh_factory("0:2,2:4", model=thinking_tiny)


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    with openai_client(mesh) as c:
        yield c


def test_reasoning_is_returned_apart_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="think", messages=ASK, max_tokens=24, temperature=0.8, seed=2
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = (whole.model_extra or {}).get("reasoning_content")
    assert reasoning and whole.content == ""
    streamed: dict[str, str] = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            extra = chunk.choices[0].delta.model_extra or {}
            streamed["reasoning_content"] += extra.get("reasoning_content") or ""
            streamed["content"] += chunk.choices[0].delta.content or ""
    assert streamed == {"reasoning_content": reasoning, "content": ""}


def test_a_schema_forced_from_the_first_id_is_the_content(client: openai.OpenAI) -> None:
    """The grammar leaves no room to reason: its JSON is the content, not reasoning."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="think",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        response_format={  # type: ignore[arg-type]
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        },
    )
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content or ""), schema)
    assert not (message.model_extra or {}).get("reasoning_content")
