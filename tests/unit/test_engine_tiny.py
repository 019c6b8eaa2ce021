"""The engine's golden invariants on the tiny model: cheap enough to check widely."""

from pathlib import Path

import numpy as np
import pytest
from invariants import recomputed_logits, solo_and_batched_ids, step_logits

from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel, load_local_model
from meshnet.errors import LayerRangeError, RequestError
from meshnet.model.sampling import SamplingParams

PROMPT = [5, 80, 99, 120, 7, 3, 200, 41]
FOLLOW = [17, 250, 3, 3, 90, 12]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_split_chain_logits_are_bit_identical(tiny: LocalModel, tiny_path: Path, k: int) -> None:
    split = load_local_model(tiny_path, split=k)
    assert len(split.chain.shards) == k
    assert np.array_equal(
        step_logits(split.chain, PROMPT, FOLLOW), step_logits(tiny.chain, PROMPT, FOLLOW)
    )


def test_cached_decode_equals_full_recompute(tiny: LocalModel) -> None:
    cached = step_logits(tiny.chain, PROMPT, FOLLOW)
    full = recomputed_logits(tiny.chain, PROMPT, FOLLOW)
    assert np.max(np.abs(cached - full)) < 1e-4


def test_batched_generation_gives_each_its_solo_tokens(tiny: LocalModel) -> None:
    prompts = [PROMPT, [9, 9, 9], FOLLOW, list(range(30, 60))]
    params = [
        SamplingParams(max_tokens=12),
        SamplingParams(max_tokens=5, temperature=0.9, seed=1),
        SamplingParams(max_tokens=9, temperature=1.3, top_k=20, seed=2),
        SamplingParams(max_tokens=12, top_p=0.5, temperature=1.0, seed=3),
    ]
    solo, batched = solo_and_batched_ids(tiny, prompts, params)
    assert solo == batched
    assert [len(ids) for ids in solo] == [12, 5, 9, 12]  # the tiny model never emits eos here


def test_seeded_sampling_is_reproducible_across_splits(tiny: LocalModel, tiny_path: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    split = load_local_model(tiny_path, split=3)
    a = generate(tiny.chain, tiny.tokenizer, PROMPT, params).ids
    assert a == generate(split.chain, split.tokenizer, PROMPT, params).ids
    assert a == generate(tiny.chain, tiny.tokenizer, PROMPT, params).ids


def test_length_stop_and_eos(tiny: LocalModel) -> None:
    g = generate(tiny.chain, tiny.tokenizer, PROMPT, SamplingParams(max_tokens=3))
    assert (len(g.ids), g.finish_reason) == (3, "length")


@pytest.mark.parametrize(
    ("prompt", "params"),
    [
        ([], SamplingParams()),
        ([10**6], SamplingParams()),
        ([-1], SamplingParams()),
        ([1] * 200, SamplingParams(max_tokens=100)),
    ],
)
def test_bad_requests_are_typed_errors(
    tiny: LocalModel, prompt: list, params: SamplingParams
) -> None:  # type: ignore[type-arg]
    with pytest.raises(RequestError):
        generate(tiny.chain, tiny.tokenizer, prompt, params)


def test_split_beyond_layer_count_is_a_typed_error(tiny_path: Path) -> None:
    with pytest.raises(LayerRangeError):
        load_local_model(tiny_path, split=5)
