"""The official ``openai`` package, unchanged, against a 3-node mesh of the bundled model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import MeshFactory

from meshnet.local_mesh import LocalMesh

pytestmark = pytest.mark.bundled


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory) -> LocalMesh:
    return mesh_factory("0:10,10:20,20:30")


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_bundled_model(client: openai.OpenAI) -> None:
    assert _model(client) == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_non_streaming(client: openai.OpenAI, oracle: dict[str, Any]) -> None:
    r = client.chat.completions.create(
        model=_model(client),
        temperature=0,
        max_tokens=48,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 8
    assert r.model_extra is not None and len(r.model_extra["meshnet"]["route"]) == 3


def test_chat_streaming_gives_the_same_text_and_ids(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=_model(client),
        max_tokens=24,
        temperature=0.9,
        seed=77,
        messages=[{"role": "user", "content": "Name three colours."}],
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    meta = finals[0].model_extra["meshnet"]  # type: ignore[index]
    assert meta["ids"] == whole.model_extra["meshnet"]["ids"]  # type: ignore[index]
    assert meta["recoveries"] == []
    first_meta = chunks[0].model_extra["meshnet"]  # type: ignore[index]
    assert [h["layers"] for h in first_meta["route"]] == [[0, 10], [10, 20], [20, 30]]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(meta["ids"])


def test_completions_streaming(client: openai.OpenAI, oracle: dict[str, Any]) -> None:
    raw = next(c for c in oracle["cases"] if c["name"] == "raw_completion")
    stream = client.completions.create(
        model=_model(client), prompt=raw["prompt_text"], temperature=0, max_tokens=12, stream=True
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == raw["hf_greedy_text"][: len(text)] and len(text) > 20


def test_errors_are_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model-not-found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=_model(client), temperature=-1, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=_model(client), messages=[])


def test_a_client_that_hangs_up_frees_every_nodes_kv(mesh: LocalMesh) -> None:
    import time

    import httpx

    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    hung_up = time.monotonic()  # 400 tokens would take several more seconds

    def kv_in_use() -> int:
        nodes = httpx.get(f"{mesh.url}/admin/nodes").json()["nodes"]
        return sum(n["load"]["kv_bytes"] + n["load"]["sessions"] for n in nodes)

    while kv_in_use() and time.monotonic() - hung_up < 3:
        time.sleep(0.1)
    assert kv_in_use() == 0
