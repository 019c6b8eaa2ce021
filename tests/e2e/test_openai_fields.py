"""The OpenAI endpoints' field contract (api/fields.py) and sampling controls, through
the official ``openai`` client against a 1-node mesh of the bundled model: every
refused field is a 400 naming it, content parts work, unknown paths are OpenAI 404s,
penalties / logit_bias / min_p change the answer as documented and are seeded, and
``n`` choices are seeded solo runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import MeshFactory
from tiny_requests import openai_client

from meshnet.local_mesh import LocalMesh

pytestmark = pytest.mark.bundled

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ASK = [{"role": "user", "content": "List the days of the week."}]


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory) -> LocalMesh:
    return mesh_factory("0:30")


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    with openai_client(mesh) as c:
        yield c


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=kwargs.pop("messages", ASK), **kwargs
    )


def _ids(response: Any) -> list[int]:
    return list(response.model_extra["meshnet"]["ids"])


REFUSED_CHAT: list[tuple[str, Any]] = [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("web_search_options", {}),
    ("verbosity", "low"),
    ("echo", True),  # a completions field: unknown here
    ("temprature", 0.5),  # a misspelt control is never a silent default
]


@pytest.mark.parametrize(("field", "value"), REFUSED_CHAT, ids=[f for f, _ in REFUSED_CHAT])
def test_each_refused_chat_field_is_a_400_naming_it(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=2, extra_body={field: value})
    assert e.value.status_code == 400
    error = e.value.body
    assert isinstance(error, dict) and error["param"] == field, error
    assert error["code"] == "unsupported-parameter" and error["type"] == "invalid_request_error"
    assert field in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("suffix", "!"), ("best_of", 3), ("frobnicate", 1)],
)
def test_each_refused_completions_field_is_a_400_naming_it(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=2, extra_body={field: value}
        )
    assert isinstance(e.value.body, dict) and e.value.body["param"] == field, e.value.body


def test_fields_that_ask_for_nothing_pass(client: openai.OpenAI) -> None:
    plain = _chat(client, max_tokens=6, temperature=0)
    same = _chat(
        client,
        max_tokens=6,
        temperature=0,
        user="u-1",
        metadata={"team": "a"},
        store=False,
        response_format={"type": "text"},
        extra_body={"modalities": ["text"], "prompt_cache_key": "k"},
    )
    assert _ids(same) == _ids(plain)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("min_p", 1.5),
        ("logit_bias", {"12": 101}),
        ("logit_bias", {"999999": 1}),
        ("logit_bias", {"the": 1}),
        ("logit_bias", {"07": 1}),
        ("n", 0),
        ("n", 17),
        ("cache_salt", ""),
        ("cache_salt", "s" * 257),
    ],
)
def test_controls_out_of_range_are_a_400_naming_them(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=2, extra_body={field: value})
    assert isinstance(e.value.body, dict) and e.value.body["param"] == field, e.value.body


def test_content_as_text_parts_is_the_joined_text(client: openai.OpenAI) -> None:
    parts = [
        {"type": "text", "text": "List the days"},
        {"type": "text", "text": "of the week."},
    ]
    joined = [{"role": "user", "content": "List the days\nof the week."}]
    as_parts = _chat(client, messages=[{"role": "user", "content": parts}], max_tokens=8, seed=1)
    as_text = _chat(client, messages=joined, max_tokens=8, seed=1)
    assert _ids(as_parts) == _ids(as_text)
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


def test_an_image_part_is_a_400_naming_it(client: openai.OpenAI) -> None:
    parts = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, messages=[{"role": "user", "content": parts}], max_tokens=2)
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "messages.0.content", body
    assert "image_url" in body["message"]


def test_a_message_field_the_template_cannot_render_is_a_400_naming_it(
    client: openai.OpenAI,
) -> None:
    named = [{"role": "user", "content": "Hi", "name": "ada"}]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, messages=named, max_tokens=2)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "messages.0.name"


def test_embeddings_and_other_missing_paths_are_openai_404s(
    client: openai.OpenAI, mesh: LocalMesh
) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model=MODEL, input="hello")
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "not_found_error", body
    assert body["code"] == "not-found" and "/v1/embeddings" in body["message"]
    anonymous = httpx.post(f"{mesh.url}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert anonymous.status_code == 401  # authenticated like the rest
    assert anonymous.json()["error"]["type"] == "authentication_error"
    wrong_method = httpx.get(f"{mesh.url}/v1/chat/completions", headers=mesh.api_headers)
    assert wrong_method.status_code == 405


def test_a_large_negative_bias_bans_a_token_and_a_positive_one_forces_it(
    client: openai.OpenAI,
) -> None:
    plain = _ids(_chat(client, max_tokens=12, temperature=0))
    banned = plain[0]
    without = _ids(_chat(client, max_tokens=12, temperature=0, logit_bias={str(banned): -100}))
    assert banned not in without
    for seed in range(3):
        ids = _ids(_chat(client, max_tokens=12, seed=seed, logit_bias={str(banned): -100}))
        assert banned not in ids
    forced = _ids(_chat(client, max_tokens=4, temperature=0.8, seed=3, logit_bias={"28": 100}))
    assert forced == [28, 28, 28, 28]


def test_a_frequency_penalty_prevents_the_repeats_the_plain_run_makes(
    client: openai.OpenAI,
) -> None:
    prompt = "Repeat after me forever: la la la la la la la la"
    kwargs: dict[str, Any] = dict(prompt=prompt, max_tokens=24, temperature=0, model=MODEL)
    plain = client.completions.create(**kwargs).model_extra["meshnet"]["ids"]  # type: ignore[index]
    assert max(plain.count(t) for t in set(plain)) >= 3  # the plain run repeats
    penalised = client.completions.create(frequency_penalty=2.0, **kwargs)
    ids = penalised.model_extra["meshnet"]["ids"]  # type: ignore[index]
    assert ids != plain
    assert max(ids.count(t) for t in set(ids)) < max(plain.count(t) for t in set(plain))
    # " la" leads by more than 2 here, so a presence penalty (subtracted once) keeps it
    # greedy; sampled, it moves the picks.
    sampled = {**kwargs, "temperature": 1.0, "seed": 5}
    unpenalised = client.completions.create(**sampled).model_extra["meshnet"]["ids"]  # type: ignore[index]
    presence = client.completions.create(presence_penalty=2.0, **sampled)
    assert presence.model_extra["meshnet"]["ids"] != unpenalised  # type: ignore[index]


def test_the_controls_are_identical_across_two_runs_with_one_seed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        max_tokens=24,
        temperature=1.0,
        seed=99,
        presence_penalty=0.7,
        frequency_penalty=1.1,
        logit_bias={"30": -5, "1017": 3},
        extra_body={"min_p": 0.05},
    )
    first, second = _chat(client, **kwargs), _chat(client, **kwargs)
    assert _ids(first) == _ids(second)
    streamed = list(_chat(client, stream=True, **kwargs))
    ids = [i for c in streamed for i in c.model_extra["meshnet"].get("ids", [])]
    assert ids[: len(_ids(first))] == _ids(first)
    assert _ids(_chat(client, **{**kwargs, "frequency_penalty": 0})) != _ids(first)


def test_n_choices_are_the_seeded_solo_runs(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(max_tokens=10, temperature=1.0, frequency_penalty=0.5)
    three = _chat(client, n=3, seed=40, **kwargs)
    solos = [_chat(client, seed=40 + i, **kwargs) for i in range(3)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    for choice, solo in zip(three.choices, solos, strict=True):
        assert choice.message.content == solo.choices[0].message.content
        assert choice.model_extra["meshnet"]["ids"] == _ids(solo)
    assert len({c.message.content for c in three.choices}) > 1
    completion = sum(s.usage.completion_tokens for s in solos)
    assert three.usage.completion_tokens == completion
    assert three.usage.prompt_tokens == solos[0].usage.prompt_tokens


def test_n_choices_stream_each_under_its_index(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(max_tokens=10, temperature=1.0, seed=40)
    whole = _chat(client, n=3, **kwargs)
    chunks = list(_chat(client, n=3, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = ["", "", ""]
    finished = set()
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert texts == [c.message.content for c in whole.choices]
    assert finished == {0, 1, 2}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_echo_starts_with_the_prompt(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="The capital of France", max_tokens=6)
    plain = client.completions.create(temperature=0, **kwargs)
    echoed = client.completions.create(temperature=0, echo=True, **kwargs)
    assert echoed.choices[0].text == "The capital of France" + plain.choices[0].text
    streamed = client.completions.create(temperature=0, echo=True, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(echo=True, logprobs=1, **kwargs)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "echo"


def test_ignore_eos_goes_on_past_the_end_of_the_answer(client: openai.OpenAI) -> None:
    # A question answered in a few tokens on every backend ("The capital of Germany is
    # Berlin."; the default, q8, runs past 16 tokens on France's, as llama.cpp does).
    ask = [{"role": "user", "content": "What is the capital of Germany?"}]
    answer = _chat(client, messages=ask, max_tokens=16, temperature=0)
    assert answer.choices[0].finish_reason == "stop"
    longer = _chat(
        client, messages=ask, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert longer.choices[0].finish_reason == "length" and len(_ids(longer)) == 16
    assert _ids(longer)[: len(_ids(answer))] == _ids(answer)
