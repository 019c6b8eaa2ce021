import numpy as np
import pytest

from meshnet.kv.cache import SequenceKV


def _fill(kv: SequenceKV, n: int, base: float) -> None:
    kv.reserve(n)
    for layer in range(kv.n_layers):
        k = np.full((kv.n_kv_heads, n, kv.head_dim), base + layer, np.float32)
        kv.write(layer, k, -k)
    kv.advance(n)


def test_growth_keeps_every_committed_position() -> None:
    kv = SequenceKV(n_layers=2, n_kv_heads=3, head_dim=4)
    _fill(kv, 50, 1.0)
    for step in range(100):  # one at a time, past several capacity doublings
        _fill(kv, 1, 100.0 + step)
    assert kv.length == 150
    keys, values = kv.view(1, 0)
    assert keys.shape == (3, 150, 4)
    assert np.all(keys[:, :50] == 2.0)
    assert np.all(keys[:, 50:, 0] == (101.0 + np.arange(100))[None, :])
    assert np.array_equal(values, -keys)


def test_write_past_reservation_is_refused() -> None:
    kv = SequenceKV(n_layers=1, n_kv_heads=1, head_dim=2)
    kv.reserve(64)
    with pytest.raises(ValueError):
        kv.write(0, np.zeros((1, 65, 2), np.float32), np.zeros((1, 65, 2), np.float32))


def test_truncate_forgets_the_tail_only() -> None:
    kv = SequenceKV(n_layers=1, n_kv_heads=1, head_dim=2)
    _fill(kv, 10, 1.0)
    kv.truncate(4)
    assert kv.length == 4
    with pytest.raises(ValueError):
        kv.truncate(5)
    assert kv.nbytes > 0
