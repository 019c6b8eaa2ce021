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
    assert (kv.length, kv.nbytes // per_position) == (168, 256)  # capacity doubled twice
    assert kv.growth_bytes(88) == 0  # 256 positions still fit
    assert kv.growth_bytes(89) == 256 * per_position  # the next doubling


def test_budget_refuses_what_does_not_fit_and_tracks_peak() -> None:
    b = KVBudget(budget_bytes=1000)
    assert b.fits(1000) and not b.fits(1001)
    b.update(600)
    assert b.fits(400) and not b.fits(401)
    b.update(100)
    assert (b.in_use, b.peak) == (100, 600)
    assert KVBudget(0).fits(10**12)
