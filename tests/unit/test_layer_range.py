import pytest

from meshnet.errors import LayerRangeError
from meshnet.layer_range import LayerRange, covers_exactly, split_evenly


def test_split_evenly_covers_all_layers_with_near_equal_sizes() -> None:
    for n_layers in (1, 4, 30):
        for parts in range(1, n_layers + 1):
            ranges = split_evenly(n_layers, parts)
            assert covers_exactly(ranges, n_layers)
            sizes = [len(r) for r in ranges]
            assert max(sizes) - min(sizes) <= 1


def test_split_of_thirty_layers_in_three() -> None:
    assert split_evenly(30, 3) == [LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30)]
    assert [len(r) for r in split_evenly(30, 4)] == [8, 8, 7, 7]


@pytest.mark.parametrize("parts", [0, 31, -1])
def test_impossible_split_is_a_typed_error(parts: int) -> None:
    with pytest.raises(LayerRangeError):
        split_evenly(30, parts)


@pytest.mark.parametrize("text", ["5:5", "7:3", "-1:4", "abc", "3", "1:2:3", ":"])
def test_bad_range_text_is_a_typed_error(text: str) -> None:
    with pytest.raises(LayerRangeError):
        LayerRange.parse(text)


def test_parse_and_bounds() -> None:
    r = LayerRange.parse("10:20")
    assert (r.start, r.end, len(r), list(r)[:2]) == (10, 20, 10, [10, 11])
    r.check_within(20)
    with pytest.raises(LayerRangeError, match="outside"):
        r.check_within(15)


def test_covers_exactly_rejects_gaps_and_overlaps() -> None:
    assert not covers_exactly([LayerRange(0, 10), LayerRange(11, 30)], 30)
    assert not covers_exactly([LayerRange(0, 12), LayerRange(10, 30)], 30)
    assert not covers_exactly([LayerRange(0, 10)], 30)
    assert covers_exactly([LayerRange(0, 10), LayerRange(10, 30)], 30)
