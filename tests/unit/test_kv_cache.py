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


def _parts(n_kv: int, sizes: list[int], hd: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n_kv, n, hd)).astype(np.float32) for n in sizes]


def test_parts_put_in_one_call_equal_each_put_alone() -> None:
    """A loaded prefix's blocks go into a layer in one call (put_parts): the same
    positions as each block put alone, in a plain layer and round a windowed ring."""
    sizes = [5, *[16] * 9, 7]  # 156 positions: past a 24-window ring's 64 slots
    n = 4 + sum(sizes)
    for windows, rings in (((0, 0), False), ((0, 24), True)):
        whole, parted = (SequenceKV(2, 2, 8, windows=windows, rings=rings) for _ in range(2))
        for kv in (whole, parted):
            kv.start_loaded(n)
        if rings:
            assert 0 < whole.ring(1) < n  # the ring goes round: positions are not slots
        for layer in range(2):
            first = n - whole.kept(layer, n)
            keys, values = _parts(2, sizes, 8, layer), _parts(2, sizes, 8, 10 + layer)
            at = 4
            for k, v in zip(keys, values, strict=True):  # each part alone, in the window
                stop = at + k.shape[1]
                if stop > first:
                    skip = max(first - at, 0)
                    whole.put_parts(layer, at + skip, (k[:, skip:],), (v[:, skip:],))
                at = stop
            if first > 4:  # a window: only its positions are the layer's to hold
                cut = first - 4
                keys, values = _cut(keys, cut), _cut(values, cut)
            parted.put_parts(layer, max(first, 4), keys, values)
            for start in range(max(first, 4), n, 8):
                stop = min(start + 8, n)
                assert np.array_equal(
                    parted.read(layer, start, stop), whole.read(layer, start, stop)
                )


def _cut(parts: list[np.ndarray], n: int) -> list[np.ndarray]:
    """``parts`` without their first ``n`` positions."""
    out = []
    for p in parts:
        if n >= p.shape[1]:
            n -= p.shape[1]
            continue
        out.append(p[:, n:])
        n = 0
    return out


def test_parts_outside_a_layers_positions_are_refused() -> None:
    kv = SequenceKV(1, 1, 8, windows=(16,), rings=True)
    kv.start_loaded(40)
    inside = _parts(1, [8, 8], 8, 0)
    with pytest.raises(ValueError):  # before the window's last 16 positions
        kv.put_parts(0, 8, inside, inside)
    with pytest.raises(ValueError):  # past the committed length
        kv.put_parts(0, 30, inside, inside)
    kv.put_parts(0, 24, inside, inside)
    assert np.array_equal(kv.read(0, 24, 40)[0], np.concatenate(inside, axis=1))
