import numpy as np
import pytest

from meshnet.errors import RequestError
from meshnet.model.sampling import (
    Sampler,
    SamplingParams,
    apply_repetition_penalty,
    nucleus,
    pick,
)

rng = np.random.default_rng(3)
LOGITS = [rng.standard_normal(500).astype(np.float32) for _ in range(40)]


def _draw(params: SamplingParams) -> list[int]:
    s = Sampler(params)
    return [s.sample(lg, [], generated_from=0) for lg in LOGITS]


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert Sampler(SamplingParams()).sample(logits, [], generated_from=0) == 1


def test_same_seed_same_tokens_and_other_seed_other_tokens() -> None:
    p = SamplingParams(temperature=1.0, seed=42)
    assert _draw(p) == _draw(p)
    assert _draw(p) != _draw(SamplingParams(temperature=1.0, seed=43))


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    greedy = _draw(SamplingParams())
    assert _draw(SamplingParams(temperature=1.5, top_k=1, seed=1)) == greedy
    assert _draw(SamplingParams(temperature=1.5, top_p=1e-9, seed=1)) == greedy


def test_top_k_keeps_only_the_k_best() -> None:
    p = SamplingParams(temperature=5.0, top_k=3, seed=7)
    s = Sampler(p)
    logits = LOGITS[0]
    best3 = set(np.argsort(-logits)[:3].tolist())
    assert {s.sample(logits, [], generated_from=0) for _ in range(200)} <= best3


def test_nucleus_keeps_the_smallest_set_reaching_top_p() -> None:
    scores = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    ids, probs = nucleus(scores, top_k=0, top_p=0.79)
    assert ids.tolist() == [0, 1]
    assert np.isclose(probs.sum(), 1.0)
    ids, _ = nucleus(scores, top_k=0, top_p=0.81)
    assert ids.tolist() == [0, 1, 2]


def test_sampling_follows_the_distribution() -> None:
    logits = np.log(np.array([0.7, 0.2, 0.1], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = (
        np.bincount([s.sample(logits, [], generated_from=0) for _ in range(4000)], minlength=3)
        / 4000
    )
    assert np.allclose(counts, [0.7, 0.2, 0.1], atol=0.03)


def test_repetition_penalty_makes_seen_tokens_less_likely() -> None:
    scores = np.array([2.0, -1.0, 1.0])
    out = apply_repetition_penalty(scores, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -2.0, 1.0]
    s = Sampler(SamplingParams(repetition_penalty=3.0))
    assert s.sample(np.array([2.0, 1.0], np.float32), [0], generated_from=0) == 1


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=0),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(repetition_penalty=0.0),
        dict(seed=-1),
        dict(stop=("",)),
        dict(stop=tuple("abcdefghijklmnopq")),
    ],
)
def test_bad_parameters_are_typed_errors(bad: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(RequestError):
        SamplingParams(**bad)


def _nucleus_by_full_sort(
    scores: np.ndarray, top_k: int, top_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """The contract of ``nucleus`` written the slow, obvious way: every candidate sorted."""
    n = len(scores)
    cut = 0 < top_k < n
    ids = np.sort(np.argpartition(-scores, top_k - 1)[:top_k]) if cut else np.arange(n)
    weights = np.exp(scores[ids] - scores[ids].max())
    probs = weights / weights.sum()
    order = np.lexsort((ids, -probs))
    if top_p >= 1.0:
        return ids[order], probs[order]
    keep = min(int(np.searchsorted(np.cumsum(probs[order]), top_p, side="left")) + 1, len(ids))
    kept = order[:keep]
    return ids[kept], probs[kept] / probs[kept].sum()


@pytest.mark.parametrize("spread", [0.5, 3.0, 30.0])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (0, 0.999), (0, 1.0), (40, 0.8), (0, 1e-9)])
def test_nucleus_sorts_only_what_it_keeps_and_keeps_what_a_full_sort_would(
    spread: float, top_k: int, top_p: float
) -> None:
    gen = np.random.default_rng(int(spread * 10) + top_k)
    for _ in range(5):
        scores = gen.standard_normal(5000) * spread
        scores[gen.integers(0, 5000, 50)] = scores.max()  # ties at the top
        scores[gen.integers(0, 5000, 200)] = np.round(scores[:200], 1)  # ties elsewhere
        got_ids, got_probs = nucleus(scores, top_k, top_p)
        want_ids, want_probs = _nucleus_by_full_sort(scores, top_k, top_p)
        assert got_ids.tolist() == want_ids.tolist()
        assert np.array_equal(got_probs, want_probs)
        for u in [*gen.random(50), 0.0, 1.0 - 1e-16]:
            at = int(np.searchsorted(np.cumsum(want_probs), u, side="right"))
            assert pick(scores, top_k, top_p, u) == want_ids[min(at, len(want_ids) - 1)]
