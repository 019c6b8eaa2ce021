"""``split_by_bytes``: the layout whose heaviest range is as light as it can be, exactly."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from meshnet.errors import LayerRangeError
from meshnet.layer_range import LayerRange, covers_exactly, split_by_bytes, split_evenly


def _costs(cuts: Sequence[int], layers: Sequence[int], first: int, last: int) -> list[int]:
    """Bytes of each range of the layout with these cuts (0 and n included)."""
    n = len(layers)
    return [
        sum(layers[a:b]) + (first if a == 0 else 0) + (last if b == n else 0)
        for a, b in itertools.pairwise(cuts)
    ]


def _best_by_brute_force(
    layers: Sequence[int], parts: int, first: int, last: int
) -> tuple[int, int]:
    """The least largest range over every layout, and the least sum of squares among
    the layouts that reach it."""
    n = len(layers)
    scored = []
    for inner in itertools.combinations(range(1, n), parts - 1):
        costs = _costs((0, *inner, n), layers, first, last)
        scored.append((max(costs), sum(c * c for c in costs)))
    return min(scored)


def test_every_small_case_is_optimal_against_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(400):
        n = rng.randint(1, 8)
        layers = [rng.randint(0, 20) for _ in range(n)]
        first, last = rng.randint(0, 40), rng.randint(0, 40)
        parts = rng.randint(1, n)
        ranges = split_by_bytes(layers, parts, first, last)
        assert len(ranges) == parts and covers_exactly(ranges, n)
        costs = _costs([0, *(r.end for r in ranges)], layers, first, last)
        got = (max(costs), sum(c * c for c in costs))
        assert got == _best_by_brute_force(layers, parts, first, last), (layers, parts)


def test_equal_layers_give_split_evenly_s_layout() -> None:
    for n in range(1, 17):
        for parts in range(1, n + 1):
            assert split_by_bytes([7] * n, parts) == split_evenly(n, parts), (n, parts)


def test_a_heavy_embedding_and_tied_head_shorten_the_end_ranges() -> None:
    # 30 layers of 1 and an embedding of 8 on both ends (the bundled model's shape):
    # an even split would hold 18 on each end node and 10 in the middle.
    ranges = split_by_bytes([1] * 30, 3, first_bytes=8, last_bytes=8)
    assert ranges == [LayerRange(0, 8), LayerRange(8, 23), LayerRange(23, 30)]
    assert max(_costs([0, 8, 23, 30], [1] * 30, 8, 8)) == 16  # 15 is impossible


def test_an_embedding_heavier_than_the_rest_gets_a_node_to_itself() -> None:
    ranges = split_by_bytes([1] * 10, 4, first_bytes=100)
    assert ranges == [LayerRange(0, 1), LayerRange(1, 4), LayerRange(4, 7), LayerRange(7, 10)]


def test_heavy_expert_layers_after_a_dense_first_one() -> None:
    # A dense first layer and mixture-of-experts layers eight times its size.
    layers = [1] + [8] * 7
    ranges = split_by_bytes(layers, 4, first_bytes=6, last_bytes=6)
    assert ranges == [LayerRange(0, 2), LayerRange(2, 4), LayerRange(4, 6), LayerRange(6, 8)]
    assert max(_costs([0, 2, 4, 6, 8], layers, 6, 6)) == 22


def test_as_many_parts_as_layers_is_one_layer_each() -> None:
    assert split_by_bytes([5, 1, 9, 2], 4, 50, 50) == [LayerRange(i, i + 1) for i in range(4)]


@pytest.mark.parametrize(
    ("layers", "parts", "first", "last"),
    [
        ([1, 2, 3], 0, 0, 0),
        ([1, 2, 3], 4, 0, 0),
        ([], 1, 0, 0),
        ([1, -2, 3], 2, 0, 0),
        ([1, 2, 3], 2, -1, 0),
        ([1, 2, 3], 2, 0, -1),
    ],
)
def test_an_impossible_split_or_negative_bytes_is_a_typed_error(
    layers: list[int], parts: int, first: int, last: int
) -> None:
    with pytest.raises(LayerRangeError):
        split_by_bytes(layers, parts, first, last)
