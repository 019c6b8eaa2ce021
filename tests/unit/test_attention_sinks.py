"""Attention sinks (gpt-oss): each head's softmax also counts e^sink, which has no value.

The numpy reference against float64 math, the numba and native kernels against the
reference, a row's bits alone, batched or chunked with sinks, and a sink too small to
count changing no bit of the kernels without sinks.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.backends import fast
from meshnet.model.layers import causal_attention

try:
    from meshnet.backends import _native as native
except ImportError:  # no compiler or no AVX2: the numba kernels only
    native = None

needs_native = pytest.mark.skipif(native is None, reason="the native extension is not built")
F32 = np.float32
H, HKV, HD = 8, 2, 16
SCALE = HD**-0.5


def _inputs(seed: int, n: int, first: int) -> tuple[np.ndarray, ...]:
    """q [n, H, hd]; keys, values [Hkv, first + n, hd]; sinks [H] from large negative
    to large positive (a head that ignores its sink, one whose sink swamps its scores)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, H, HD)).astype(F32)
    keys = rng.standard_normal((HKV, first + n, HD)).astype(F32) * 2
    values = rng.standard_normal((HKV, first + n, HD)).astype(F32)
    sinks = np.linspace(-20, 12, H).astype(F32)
    return q, keys, values, sinks


def _float64_attention(q, keys, values, first, sinks, scale, softcap=0.0, window=0):  # type: ignore[no-untyped-def]
    """The formula, row by row in float64: weights e^s / (sum e^s + e^sink)."""
    n = q.shape[0]
    g = H // HKV
    out = np.zeros((n, H, HD))
    for i in range(n):
        end = first + i + 1
        start = max(0, end - window) if window else 0
        for h in range(H):
            k = keys[h // g, start:end].astype(np.float64)
            s = k @ q[i, h].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            top = max(s.max(), float(sinks[h]))
            e = np.exp(s - top)
            w = e / (e.sum() + np.exp(float(sinks[h]) - top))
            out[i, h] = w @ values[h // g, start:end].astype(np.float64)
    return out.reshape(n, H * HD)


@pytest.mark.parametrize(("softcap", "window"), [(0.0, 0), (3.0, 0), (0.0, 5)])
def test_the_reference_counts_each_heads_sink_as_the_formula_does(
    softcap: float, window: int
) -> None:
    q, keys, values, sinks = _inputs(0, 4, 9)
    got = causal_attention(q, keys, values, 9, SCALE, softcap, window, sinks)
    want = _float64_attention(q, keys, values, 9, sinks, SCALE, softcap, window)
    assert np.allclose(got, want, atol=2e-6, rtol=0)
    plain = causal_attention(q, keys, values, 9, SCALE, softcap, window)
    big = H - 1  # sink 12: most of the weight goes to nothing
    rows = slice(big * HD, (big + 1) * HD)
    assert np.abs(got[:, rows]).max() < 0.2 * np.abs(plain[:, rows]).max()


def test_numba_rows_with_sinks_match_the_reference() -> None:
    q, keys, values, sinks = _inputs(1, 5, 11)
    for window in (0, 4):
        got = fast._attention(q, keys, values, 11, SCALE, 2.5, window, sinks)
        want = causal_attention(q, keys, values, 11, SCALE, 2.5, window, sinks)
        assert np.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_numba_rows_get_the_same_bits_alone_or_in_a_chunk() -> None:
    q, keys, values, sinks = _inputs(2, 6, 3)
    ck, cv, _, _ = _cache(keys, values, 9)  # views of a cache, as a sequence's KV gives them

    def attend(rows: slice) -> np.ndarray:
        end = 3 + rows.stop
        return fast._attention(
            q[rows], ck[:, :end], cv[:, :end], 3 + rows.start, SCALE, sinks=sinks
        )

    alone = [attend(slice(i, i + 1)) for i in range(6)]
    assert np.array_equal(attend(slice(0, 6)), np.concatenate(alone))
    assert np.array_equal(attend(slice(2, 5)), np.concatenate(alone[2:5]))


def test_a_sink_too_small_to_count_changes_no_bit_in_numba() -> None:
    q, keys, values, _ = _inputs(3, 3, 7)
    tiny = np.full(H, -1e30, F32)
    with_sink = fast._attention(q, keys, values, 7, SCALE, 1.5, 3, tiny)
    assert np.array_equal(with_sink, fast._attention(q, keys, values, 7, SCALE, 1.5, 3))
    reference = causal_attention(q, keys, values, 7, SCALE, 1.5, 3, tiny)
    assert np.array_equal(reference, causal_attention(q, keys, values, 7, SCALE, 1.5, 3))


def _native_call(q, k, v, entries, sinks, window=0):  # type: ignore[no-untyped-def]
    """``_native.attend`` with sinks: entries (keys, values, first, count, row) over caches
    [Hkv, capacity, hd], the new rows' k, v [T, Hkv, hd]."""
    assert native is not None
    out = np.empty((q.shape[0], H * HD), F32)
    native.attend(q, k, v, out, entries, q.shape[0], H, HKV, HD, 2, SCALE, 0.0, window, sinks)
    return out


def _cache(keys: np.ndarray, values: np.ndarray, first: int) -> tuple[np.ndarray, ...]:
    """A cache holding the first ``first`` positions with room for the rest and 3 more,
    and the rest as new rows [n, Hkv, hd]."""
    capacity = keys.shape[1] + 3
    ck = np.zeros((HKV, capacity, HD), F32)
    cv = np.zeros((HKV, capacity, HD), F32)
    ck[:, :first], cv[:, :first] = keys[:, :first], values[:, :first]
    new_k = np.ascontiguousarray(keys[:, first:].transpose(1, 0, 2))
    new_v = np.ascontiguousarray(values[:, first:].transpose(1, 0, 2))
    return ck, cv, new_k, new_v


@needs_native
@pytest.mark.parametrize("window", [0, 4])
def test_native_rows_with_sinks_match_the_reference(window: int) -> None:
    q, keys, values, sinks = _inputs(4, 5, 30)
    ck, cv, k, v = _cache(keys, values, 30)
    got = _native_call(q, k, v, [(ck, cv, 30, 5, 0)], sinks, window)
    want = causal_attention(q, keys, values, 30, SCALE, window=window, sinks=sinks)
    assert np.allclose(got, want, atol=1e-6, rtol=1e-5)


@needs_native
def test_a_native_row_gets_the_same_bits_alone_chunked_or_among_others() -> None:
    q, keys, values, sinks = _inputs(5, 4, 10)
    ck, cv, k, v = _cache(keys, values, 10)
    whole = _native_call(q, k, v, [(ck.copy(), cv.copy(), 10, 4, 0)], sinks)
    one_by_one = [
        _native_call(q[i : i + 1], k[i : i + 1], v[i : i + 1], [(ck, cv, 10 + i, 1, 0)], sinks)
        for i in range(4)
    ]
    assert np.array_equal(whole, np.concatenate(one_by_one))
    oq, okeys, ovalues, _ = _inputs(6, 1, 40)
    ock, ocv, ok, ov = _cache(okeys, ovalues, 40)
    ck2, cv2, _, _ = _cache(keys, values, 10)
    mixed = _native_call(
        np.concatenate([oq, q[:2]]),
        np.concatenate([ok, k[:2]]),
        np.concatenate([ov, v[:2]]),
        [(ock, ocv, 40, 1, 0), (ck2, cv2, 10, 2, 1)],
        sinks,
    )
    assert np.array_equal(mixed[1:], whole[:2])


@needs_native
def test_a_sink_too_small_to_count_changes_no_native_bit() -> None:
    q, keys, values, _ = _inputs(7, 3, 12)
    ck, cv, k, v = _cache(keys, values, 12)
    tiny = np.full(H, -1e30, F32)
    with_sink = _native_call(q, k, v, [(ck.copy(), cv.copy(), 12, 3, 0)], tiny, 5)
    assert np.array_equal(with_sink, _native_call(q, k, v, [(ck, cv, 12, 3, 0)], None, 5))


@needs_native
@pytest.mark.parametrize(
    "sinks",
    [
        np.zeros(H - 1, F32),  # one per head, or refused
        np.zeros(H, np.float64),
        np.array([0.0] * (H - 1) + [np.nan], F32),
        np.array([np.inf] + [0.0] * (H - 1), F32),
    ],
)
def test_native_sinks_that_do_not_fit_are_refused_before_anything_is_written(
    sinks: np.ndarray,
) -> None:
    q, keys, values, _ = _inputs(8, 2, 3)
    ck, cv, k, v = _cache(keys, values, 3)
    before = ck.copy()
    with pytest.raises(ValueError, match="sinks"):
        _native_call(q, k, v, [(ck, cv, 3, 2, 0)], sinks)
    assert np.array_equal(ck, before)
