"""How a router's logits choose a row's experts and weigh them, per family rule."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.model.experts import route
from meshnet.model.layers import softmax
from meshnet.model.spec import Experts

F32 = np.float32


def _experts(gating: str = "softmax", normalize: bool = False, used: int = 2) -> Experts:
    return Experts(n_experts=5, n_used=used, d_ff=32, gating=gating, normalize=normalize)  # type: ignore[arg-type]


LOGITS = np.array([[0.5, 3.0, -1.0, 2.0, 2.5], [4.0, 0.0, 0.0, 1.0, -2.0]], F32)


def test_softmax_routing_keeps_the_most_probable_experts_best_first() -> None:
    ids, weights = route(LOGITS, _experts())
    assert ids.tolist() == [[1, 4], [0, 3]]
    probs = softmax(LOGITS)
    assert np.allclose(weights, np.take_along_axis(probs, ids, axis=1))
    assert np.all(weights.sum(axis=1) < 1)  # Qwen2-MoE keeps the weights as they are


def test_normalized_weights_sum_to_one() -> None:
    _, weights = route(LOGITS, _experts(normalize=True, used=3))
    assert np.allclose(weights.sum(axis=1), 1.0, atol=1e-6)


def test_softmax_of_the_chosen_weighs_only_them() -> None:
    ids, weights = route(LOGITS, _experts(gating="softmax_chosen"))
    assert ids.tolist() == [[1, 4], [0, 3]]
    assert np.allclose(weights[0], softmax(np.array([3.0, 2.5], F32)))


def test_ties_go_to_the_lower_expert() -> None:
    ids, _ = route(np.array([[1.0, 2.0, 2.0, 2.0, 0.0]], F32), _experts(used=2))
    assert ids.tolist() == [[1, 2]]


@pytest.mark.parametrize("gating", ["softmax", "softmax_chosen"])
def test_a_row_is_routed_alike_alone_or_beside_others(gating: str) -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((9, 5)).astype(F32)
    ids, weights = route(logits, _experts(gating, normalize=True))
    for r in range(9):
        alone_ids, alone_weights = route(logits[r : r + 1], _experts(gating, normalize=True))
        assert np.array_equal(alone_ids[0], ids[r])
        assert np.array_equal(alone_weights[0], weights[r])


def test_a_selection_bias_chooses_but_never_weighs() -> None:
    e = Experts(n_experts=5, n_used=2, d_ff=32, gating="sigmoid", normalize=False)
    bias = np.array([0.0, 0.0, 5.0, 0.0, 0.0], F32)  # expert 2 chosen despite its logit
    ids, weights = route(LOGITS, e, bias)
    assert ids.tolist() == [[2, 1], [2, 0]]
    sig = 1 / (1 + np.exp(-LOGITS.astype(np.float64)))
    assert np.allclose(weights, np.take_along_axis(sig, ids, axis=1), atol=1e-7)


def test_normalized_weights_are_then_scaled() -> None:
    e = Experts(n_experts=5, n_used=3, d_ff=32, gating="sigmoid", normalize=True, scale=2.5)
    _, weights = route(LOGITS, e)
    assert np.allclose(weights.sum(axis=1), 2.5, atol=1e-6)


def test_grouped_routing_chooses_within_the_groups_of_the_best_two() -> None:
    # groups {0,1} {2,3} {4,5}: scored 3 + 0, 2 + 2, 2.5 + 0.1; the best two are kept
    logits = np.array([[3.0, 0.0, 2.0, 2.0, 2.5, 0.1]], F32)
    e = Experts(6, 3, 32, "softmax_chosen", False, n_groups=3, n_groups_used=2)
    ids, _ = route(logits, e)
    assert ids.tolist() == [[0, 2, 3]]  # expert 4 (2.5) is in the dropped group
    plain = Experts(6, 3, 32, "softmax_chosen", False)
    assert route(logits, plain)[0].tolist() == [[0, 4, 2]]
