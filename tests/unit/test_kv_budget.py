from meshnet.kv.cache import SequenceKV
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
    """Room past the need is 1/8 of it (at least 64 positions, at most 8 MB): a budget that
    counts capacity is never half empty when a session's next token is refused."""
    kv = SequenceKV(n_layers=2, n_kv_heads=2, head_dim=8)  # 128 bytes a position
    kv.reserve(4000)
    kv.advance(4000)
    assert kv.nbytes == 4000 * kv.per_position  # a first reservation is what it asks
    assert kv.growth_bytes(1) == (1 + 4001 // 8) * kv.per_position
    wide = SequenceKV(n_layers=16, n_kv_heads=8, head_dim=128)  # 128 KiB a position
    wide.reserve(4000)
    wide.advance(4000)
    assert wide.growth_bytes(1) == (1 + 64) * wide.per_position  # 8 MB of room is 64


def test_budget_refuses_what_does_not_fit_and_tracks_peak() -> None:
    b = KVBudget(budget_bytes=1000)
    assert b.fits(1000) and not b.fits(1001)
    b.update(600)
    assert b.fits(400) and not b.fits(401)
    b.update(100)
    assert (b.in_use, b.peak) == (100, 600)
    assert KVBudget(0).fits(10**12)
