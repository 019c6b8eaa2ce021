from meshnet.kv.cache import SequenceKV, grown_capacity
from meshnet.kv.manager import KVBudget


def test_growth_bytes_predicts_reserve_exactly() -> None:
    kv = SequenceKV(n_layers=3, n_kv_heads=2, head_dim=8)
    for n in (5, 60, 1, 100, 1, 1):
        expected = kv.nbytes + kv.growth_bytes(n)
        kv.reserve(n)
        assert kv.nbytes == expected
        kv.advance(n)
    per_position = 2 * 3 * 2 * 8 * 4  # k and v, layers, kv heads, head dim, float32
    # 64 for the first 5, then 65 + 64 of room, then 166 + 64: each growth leaves 64 free
    assert (kv.length, kv.nbytes // per_position) == (168, 230)
    assert kv.growth_bytes(62) == 0  # 230 positions still fit
    assert kv.growth_bytes(63) == 65 * per_position  # 231 needed, 64 more of room


def test_a_long_cache_grows_by_an_eighth_not_double() -> None:
    """Room past the need is 1/8 of it (at least 64 positions): a budget that counts
    capacity is at most an eighth empty when a session's next token is refused."""
    kv = SequenceKV(n_layers=2, n_kv_heads=2, head_dim=8)  # 128 bytes a position
    kv.reserve(4000)
    kv.advance(4000)
    assert kv.nbytes == 4000 * kv.per_position  # a first reservation is what it asks
    assert kv.growth_bytes(1) == (1 + 4001 // 8) * kv.per_position


def test_growing_a_long_cache_copies_a_bounded_multiple_of_it() -> None:
    """Room geometric in the need keeps appending amortised O(1): a cache grown to 32k
    positions in 128-row prefill chunks copies a few times its final size, not once per
    chunk (a cap of 8 MB of room on a 1B model's 64 KiB positions: ~128x)."""
    capacity, copied = 0, 0
    for length in range(0, 32768, 128):
        grown = grown_capacity(capacity, length + 128)
        copied += length if grown != capacity else 0  # a growth copies what is held
        capacity = grown
    assert copied <= 10 * 32768


def test_budget_refuses_what_does_not_fit_and_tracks_peak() -> None:
    b = KVBudget(budget_bytes=1000)
    assert b.fits(1000) and not b.fits(1001)
    b.update(600)
    assert b.fits(400) and not b.fits(401)
    b.update(100)
    assert (b.in_use, b.peak) == (100, 600)
    assert KVBudget(0).fits(10**12)
