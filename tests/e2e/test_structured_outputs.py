"""Structured outputs through the official ``openai`` client, on a mesh of the bundled model.

A: 0:15; B and B': 15:30 (B' takes over when a test kills the last hop mid-way).
The schema is enforced by constrained decoding on the route's last hop, so even
sampling at temperature 1 from a 135M model gives JSON that validates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from conftest import MeshFactory
from streams import at, serving, stream_completion
from tiny_requests import openai_client

from meshnet.local_mesh import LocalMesh
from meshnet.model.info import load_model_info

pytestmark = pytest.mark.bundled

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]
SEEDS = range(20)


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory) -> LocalMesh:
    return mesh_factory("0:15,15:30,15:30", tracker_args=["--step-timeout", "3"])


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    with openai_client(mesh) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def plain(client: openai.OpenAI, model: str) -> dict[int, str]:
    """Each seed's whole answer (temperature 1: the model is free to wander)."""
    out: dict[int, str] = {}
    for seed in SEEDS:
        r = client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=FORMAT,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        assert r.choices[0].finish_reason == "stop", (seed, r.choices[0].message.content)
        out[seed] = r.choices[0].message.content or ""
    return out


def test_json_schema_answers_validate_for_20_seeds(plain: dict[int, str]) -> None:
    for text in plain.values():
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(plain.values())) > 1, "the seeds sample different answers"


def test_streamed_answers_validate_and_equal_the_whole_ones(
    client: openai.OpenAI, model: str, plain: dict[int, str]
) -> None:
    for seed in SEEDS:
        chunks = client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=FORMAT,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == plain[seed]


def test_json_object_gives_an_object(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # cut by max_tokens: still the start of an object
        assert choice.finish_reason == "length"
        assert (choice.message.content or "").startswith("{")


def test_too_few_tokens_stop_with_length(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=FORMAT,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=4,
    )
    assert r.choices[0].finish_reason == "length"
    assert (r.choices[0].message.content or "").startswith('{"')


@pytest.mark.parametrize(
    "schema", [{"type": "integer", "minimum": 5, "maximum": 1}, {"$ref": "#/nowhere"}]
)
def test_a_schema_the_engine_refuses_is_a_400_naming_response_format(
    client: openai.OpenAI, model: str, schema: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format={  # type: ignore[arg-type]
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": schema, "strict": True},
            },
            max_tokens=8,
        )
    assert e.value.status_code == 400
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "response_format"


def test_a_malformed_response_format_is_a_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format={"type": "xml"},  # type: ignore[arg-type]
            max_tokens=8,
        )
    assert isinstance(e.value.body, dict) and "response_format" in str(e.value.body["param"])


def test_failover_mid_constrained_generation_gives_the_same_answer(
    mesh: LocalMesh, model: str
) -> None:
    """The last hop dies at the 6th token: its replacement rebuilds the grammar's state
    from the generated ids and samples on exactly as the first would have."""
    body = {
        "model": model,
        "prompt": "A city described as JSON: ",
        "temperature": 0.9,
        "seed": 5,
        "max_tokens": 60,
        "response_format": FORMAT,
    }
    whole = stream_completion(mesh, body)
    assert whole.error is None and whole.final is not None and whole.final["recoveries"] == []
    killed = stream_completion(mesh, body, at(6, lambda s: mesh.kill_node(serving(s, (15, 30)))))
    assert killed.error is None, killed.error
    assert killed.final is not None and len(killed.final["recoveries"]) == 1
    assert killed.ids == whole.ids
    tokenizer = load_model_info().tokenizer
    text = tokenizer.decode([i for i in whole.ids if i not in tokenizer.eog_ids])
    jsonschema.validate(json.loads(text), SCHEMA)
