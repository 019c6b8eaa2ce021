import numpy as np
import pytest

from meshnet.model.layers import causal_attention, rms_norm, softmax
from meshnet.model.rope import Rope, RopeStyle, RopeTables, rotate

rng = np.random.default_rng(0)


def test_rms_norm_gives_unit_rms_times_weight() -> None:
    x = rng.standard_normal((5, 64)).astype(np.float32) * 7
    out = rms_norm(x, np.full(64, 2.0, np.float32), 1e-6)
    assert np.allclose(np.sqrt(np.mean(out**2, axis=-1)), 2.0, atol=1e-4)


def rope(x: np.ndarray, positions: np.ndarray, r: Rope) -> np.ndarray:
    return rotate(x, *r.tables(positions), r.style)


def test_rope_rotates_adjacent_pairs_and_keeps_norms() -> None:
    r = Rope("pairs", 8, 10000.0)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    pos = np.array([0, 1, 17])
    out = rope(x, pos, r)
    assert np.allclose(out[0], x[0])  # position 0 is the identity
    pairs_in = np.hypot(x[..., 0::2], x[..., 1::2])
    pairs_out = np.hypot(out[..., 0::2], out[..., 1::2])
    assert np.allclose(pairs_in, pairs_out, atol=1e-5)
    # pair 0 of position 1 turns by exactly 1 radian (inv_freq[0] == 1)
    c, s = np.cos(1.0), np.sin(1.0)
    assert np.allclose(out[1, :, 0], x[1, :, 0] * c - x[1, :, 1] * s, atol=1e-6)


@pytest.mark.parametrize("style", ["pairs", "halves"])
def test_rope_relative_property(style: RopeStyle) -> None:
    r = Rope(style, 16, 10000.0)
    q = rng.standard_normal((1, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 16)).astype(np.float32)

    def score(pq: int, pk: int) -> float:
        return float(np.sum(rope(q, np.array([pq]), r) * rope(k, np.array([pk]), r)))

    assert np.isclose(score(5, 2), score(13, 10), atol=1e-4)


def test_neox_rope_rotates_the_two_halves_and_leaves_the_rest() -> None:
    r = Rope("halves", 8, 10000.0)  # 8 of 12 dims rotate: pairs (i, i + 4)
    x = rng.standard_normal((2, 3, 12)).astype(np.float32)
    out = rope(x, np.array([0, 1]), r)
    assert np.allclose(out[0], x[0])
    assert np.array_equal(out[..., 8:], x[..., 8:])
    c, s = np.cos(1.0), np.sin(1.0)  # pair 0 at position 1 turns by 1 radian
    assert np.allclose(out[1, :, 0], x[1, :, 0] * c - x[1, :, 4] * s, atol=1e-6)
    assert np.allclose(out[1, :, 4], x[1, :, 0] * s + x[1, :, 4] * c, atol=1e-6)


def test_rope_factors_and_linear_scaling_slow_the_rotation() -> None:
    plain = Rope("pairs", 4, 10000.0).inv_freq()
    assert np.allclose(Rope("pairs", 4, 10000.0, factors=(2.0, 4.0)).inv_freq(), plain / [2, 4])
    cos, _ = Rope("pairs", 4, 10000.0, scale=0.5).tables(np.array([2]))
    assert np.allclose(cos, np.cos(1.0 * plain))


def _naive_attention(q, keys, values, first_pos):  # type: ignore[no-untyped-def]
    n, n_heads, hd = q.shape
    g = n_heads // keys.shape[0]
    out = np.zeros((n, n_heads, hd), np.float32)
    for i in range(n):
        visible = first_pos + i + 1
        for h in range(n_heads):
            s = keys[h // g, :visible] @ q[i, h] / np.sqrt(hd)
            out[i, h] = softmax(s) @ values[h // g, :visible]
    return out.reshape(n, n_heads * hd)


def test_grouped_causal_attention_matches_a_naive_loop() -> None:
    q = rng.standard_normal((3, 6, 8)).astype(np.float32)
    keys = rng.standard_normal((2, 7, 8)).astype(np.float32)
    values = rng.standard_normal((2, 7, 8)).astype(np.float32)
    got = causal_attention(q, keys, values, first_pos=4)
    assert np.allclose(got, _naive_attention(q, keys, values, 4), atol=1e-5)


def test_attention_never_reads_future_positions() -> None:
    q = rng.standard_normal((2, 2, 4)).astype(np.float32)
    keys = rng.standard_normal((1, 5, 4)).astype(np.float32)
    values = rng.standard_normal((1, 5, 4)).astype(np.float32)
    base = causal_attention(q, keys, values, first_pos=3)
    keys[:, 4] += 100.0
    values[:, 4] += 100.0
    changed = causal_attention(q, keys, values, first_pos=3)
    assert np.array_equal(base[0], changed[0])  # position 3 cannot see position 4
    assert not np.array_equal(base[1], changed[1])


def test_windowed_and_soft_capped_attention_match_a_naive_loop() -> None:
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    keys = rng.standard_normal((2, 9, 8)).astype(np.float32) * 3
    values = rng.standard_normal((2, 9, 8)).astype(np.float32)
    got = causal_attention(q, keys, values, first_pos=6, scale=0.3, softcap=2.0, window=4)
    want = np.zeros((3, 4, 8), np.float32)
    for i in range(3):
        pos = 6 + i
        for h in range(4):
            s = keys[h // 2, pos - 3 : pos + 1] @ q[i, h] * 0.3
            want[i, h] = softmax(2.0 * np.tanh(s / 2.0)) @ values[h // 2, pos - 3 : pos + 1]
    assert np.allclose(got, want.reshape(3, 32), atol=1e-5)


def test_rope_tables_give_a_position_the_same_numbers_whatever_asks() -> None:
    tables = RopeTables(Rope("halves", 16, 500000.0, factors=tuple(np.linspace(1, 8, 8))))
    late = np.array([5000, 3, 1023, 1024, 70000])
    cos, sin = tables.at(late)
    again = [tables.at(np.array([p])) for p in late]
    assert np.array_equal(cos, np.concatenate([c for c, _ in again]))
    assert np.array_equal(sin, np.concatenate([s for _, s in again]))
    want_cos, want_sin = tables.rope.tables(late)
    assert np.allclose(cos, want_cos, atol=1e-6) and np.allclose(sin, want_sin, atol=1e-6)
