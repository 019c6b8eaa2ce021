"""The official ``openai`` package, unchanged, against a 3-node mesh of the bundled model.

The nodes run the default backend (q8), so answers are held to the in-process engine on
it (the ``bundled`` fixture), not to the fp32 oracle: q8 multiplies 8-bit activations as
llama.cpp does and, like llama.cpp, answers the capital question otherwise
(test_mesh_oracle.py holds ``fast`` meshes to the oracle)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from conftest import MeshFactory
from solo import solo_chat_ids, solo_completion_ids
from tiny_requests import openai_client

from meshnet.engine.local import LocalModel
from meshnet.local_mesh import LocalMesh
from meshnet.model.chat import ChatMessage
from meshnet.model.logprobs import token_logprobs

pytestmark = pytest.mark.bundled


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory) -> LocalMesh:
    return mesh_factory("0:10,10:20,20:30")


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    with openai_client(mesh) as c:
        yield c


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_bundled_model(client: openai.OpenAI) -> None:
    assert _model(client) == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_non_streaming(client: openai.OpenAI, bundled: LocalModel) -> None:
    body: dict[str, Any] = dict(
        model=_model(client),
        temperature=0,
        max_tokens=48,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    r = client.chat.completions.create(**body)
    want = solo_chat_ids(bundled, body)
    assert r.choices[0].message.content == bundled.tokenizer.decode(want)
    assert r.choices[0].finish_reason == ("length" if len(want) == 48 else "stop")
    assert r.usage is not None and r.usage.completion_tokens == len(want)
    assert r.model_extra is not None and len(r.model_extra["meshnet"]["route"]) == 3
    assert r.model_extra["meshnet"]["ids"] == want


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


def test_completions_streaming(
    client: openai.OpenAI, bundled: LocalModel, oracle: dict[str, Any]
) -> None:
    raw = next(c for c in oracle["cases"] if c["name"] == "raw_completion")
    body: dict[str, Any] = dict(
        model=_model(client), prompt=raw["prompt_text"], temperature=0, max_tokens=12
    )
    stream = client.completions.create(stream=True, **body)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == bundled.tokenizer.decode(solo_completion_ids(bundled, body))
    assert len(text) > 20


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
    with httpx.stream(
        "POST", f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=60
    ) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    hung_up = time.monotonic()  # 400 tokens would take several more seconds

    def kv_in_use() -> int:
        nodes = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers).json()["nodes"]
        return sum(n["load"]["kv_bytes"] + n["load"]["sessions"] for n in nodes)

    while kv_in_use() and time.monotonic() - hung_up < 3:
        time.sleep(0.1)
    assert kv_in_use() == 0


def _local_logprobs(bundled: LocalModel, prompt: list[int], ids: list[int], top: int) -> list[Any]:
    """Each generated id's log-probabilities from the in-process engine's logits."""
    chain = bundled.chain
    kv = chain.new_sequence()
    logits = chain.forward(np.asarray(prompt, dtype=np.int64), [kv], [len(prompt)])[0]
    out = []
    for token in ids:
        out.append(token_logprobs(logits, token, top))
        logits = chain.forward(np.asarray([token], dtype=np.int64), [kv], [1])[0]
    return out


def test_chat_logprobs_are_the_models_own(client: openai.OpenAI, bundled: LocalModel) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    kwargs: dict[str, Any] = dict(
        model=_model(client), max_tokens=10, temperature=0.7, seed=5, messages=messages
    )
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kwargs)
    assert r.model_extra is not None
    ids = r.model_extra["meshnet"]["ids"]
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(ids)
    prompt = bundled.tokenizer.encode(
        bundled.template.render([ChatMessage("user", "Name three colours.")])
    )
    for got, want in zip(content, _local_logprobs(bundled, prompt, ids, 3), strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-9)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [lp for _, lp in want.top], abs=1e-9
        )
        assert [t.token for t in got.top_logprobs] == [
            bundled.tokenizer.decode([i]) for i, _ in want.top
        ]
    streamed = list(
        client.chat.completions.create(stream=True, logprobs=True, top_logprobs=3, **kwargs)
    )
    pieces = [
        entry
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for entry in c.choices[0].logprobs.content or []
    ]
    assert [p.logprob for p in pieces] == [c.logprob for c in content]
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_completion_logprobs_in_the_legacy_shape(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=_model(client), prompt="The capital of France is", max_tokens=4, temperature=0,
        logprobs=2,
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert lp.top_logprobs is not None and lp.token_logprobs is not None
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob)  # greedy: the best
        assert top[token] == pytest.approx(logprob) and logprob <= 0


def test_top_logprobs_without_logprobs_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=_model(client), max_tokens=2, top_logprobs=2,
            messages=[{"role": "user", "content": "hi"}],
        )  # fmt: skip
