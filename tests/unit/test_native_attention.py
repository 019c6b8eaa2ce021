"""The native decode attention: the causal math, one row's result whatever shares the
call, and caches or rows that do not fit refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.backends import fast
from meshnet.model.layers import causal_attention

native = pytest.importorskip("meshnet.backends._native")

H, HKV, HD = 6, 2, 16


def _cache(rng: np.random.Generator, length: int, capacity: int) -> tuple[np.ndarray, ...]:
    keys = np.zeros((HKV, capacity, HD), np.float32)
    values = np.zeros((HKV, capacity, HD), np.float32)
    keys[:, :length] = rng.standard_normal((HKV, length, HD))
    values[:, :length] = rng.standard_normal((HKV, length, HD))
    return keys, values


def _call(q, k, v, entries) -> np.ndarray:  # type: ignore[no-untyped-def]
    out = np.empty((q.shape[0], H * HD), np.float32)
    native.attend(q, k, v, out, entries, q.shape[0], H, HKV, HD, 2)
    return out


def test_rows_of_several_sequences_attend_their_own_cache_causally() -> None:
    rng = np.random.default_rng(0)
    lengths, counts = [5, 0, 30], [1, 3, 2]  # a decode row, replayed rows, two more
    t = sum(counts)
    q = rng.standard_normal((t, H, HD)).astype(np.float32)
    k = rng.standard_normal((t, HKV, HD)).astype(np.float32)
    v = rng.standard_normal((t, HKV, HD)).astype(np.float32)
    caches = [_cache(rng, n, n + c + 3) for n, c in zip(lengths, counts, strict=True)]
    entries, row = [], 0
    for (keys, values), n, c in zip(caches, lengths, counts, strict=True):
        entries.append((keys, values, n, c, row))
        row += c
    out = _call(q, k, v, entries)
    row = 0
    for (keys, values), n, c in zip(caches, lengths, counts, strict=True):
        mine = slice(row, row + c)
        assert np.array_equal(keys[:, n : n + c], k[mine].transpose(1, 0, 2))  # stored
        assert np.array_equal(values[:, n : n + c], v[mine].transpose(1, 0, 2))
        expect = causal_attention(q[mine], keys[:, : n + c], values[:, : n + c], n)
        assert np.allclose(out[mine], expect.reshape(c, H * HD), atol=1e-5)
        numba_rows = fast._attention(q[mine], keys[:, : n + c], values[:, : n + c], n, HD**-0.5)
        assert np.allclose(out[mine], numba_rows, atol=1e-5)
        row += c


def test_a_row_gets_the_same_bits_alone_replayed_or_among_others() -> None:
    rng = np.random.default_rng(1)
    keys, values = _cache(rng, 12, 20)
    q = rng.standard_normal((3, H, HD)).astype(np.float32)
    k = rng.standard_normal((3, HKV, HD)).astype(np.float32)
    v = rng.standard_normal((3, HKV, HD)).astype(np.float32)
    replayed = _call(q, k, v, [(keys.copy(), values.copy(), 12, 3, 0)])
    one_by_one = [
        _call(q[i : i + 1], k[i : i + 1], v[i : i + 1], [(keys, values, 12 + i, 1, 0)])
        for i in range(3)
    ]
    assert np.array_equal(replayed, np.concatenate(one_by_one))
    other_keys, other_values = _cache(rng, 40, 64)
    qq = np.concatenate([rng.standard_normal((1, H, HD)).astype(np.float32), q[:1]])
    kk = np.concatenate([rng.standard_normal((1, HKV, HD)).astype(np.float32), k[:1]])
    vv = np.concatenate([rng.standard_normal((1, HKV, HD)).astype(np.float32), v[:1]])
    keys2, values2 = _cache(np.random.default_rng(1), 12, 20)
    mixed = _call(qq, kk, vv, [(other_keys, other_values, 40, 1, 0), (keys2, values2, 12, 1, 1)])
    assert np.array_equal(mixed[1], one_by_one[0][0])


@pytest.mark.parametrize(
    "entry",
    [
        lambda keys, values: (keys, values, 19, 2, 0),  # past the capacity
        lambda keys, values: (keys, values[:, :10], 3, 1, 0),  # mismatched arrays
        lambda keys, values: (keys, values, 3, 1, 5),  # rows outside the batch
        lambda keys, values: (keys, values, -1, 1, 0),
        lambda keys, values: (keys.astype(np.float64), values, 3, 1, 0),
    ],
)
def test_a_cache_or_rows_that_do_not_fit_are_refused_and_nothing_is_written(entry) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(2)
    keys, values = _cache(rng, 3, 20)
    before = keys.copy(), values.copy()
    q = np.ones((2, H, HD), np.float32)
    k = np.ones((2, HKV, HD), np.float32)
    good = (np.zeros((HKV, 8, HD), np.float32), np.zeros((HKV, 8, HD), np.float32), 0, 1, 1)
    with pytest.raises(ValueError):
        _call(q, k, k, [good, entry(keys, values)])
    assert np.array_equal(keys, before[0]) and np.array_equal(values, before[1])
    assert not good[0].any()  # the valid entry was not written either


def _paged(keys: np.ndarray, values: np.ndarray, shared: int) -> tuple[list, np.ndarray]:  # type: ignore[type-arg]
    """Positions 0 .. shared of a cache as pages of 64 (kv/pages.py's layout, one layer),
    and their address table."""
    pages = []
    for p in range(shared // 64):
        page = np.zeros((1, 2, HKV, 64, HD), np.float32)
        page[0, 0], page[0, 1] = keys[:, p * 64 : (p + 1) * 64], values[:, p * 64 : (p + 1) * 64]
        pages.append(page)
    table = np.array(
        [[p[0, 0].ctypes.data for p in pages], [p[0, 1].ctypes.data for p in pages]], np.int64
    )
    return pages, table


@pytest.mark.parametrize(("length", "count"), [(128, 1), (191, 1), (192, 70), (300, 5)])
def test_positions_read_from_pages_give_the_bits_of_one_array(length: int, count: int) -> None:
    rng = np.random.default_rng(3)
    keys, values = _cache(rng, length, length + count)
    q = rng.standard_normal((count, H, HD)).astype(np.float32)
    k = rng.standard_normal((count, HKV, HD)).astype(np.float32)
    v = rng.standard_normal((count, HKV, HD)).astype(np.float32)
    whole = _call(q, k, v, [(keys.copy(), values.copy(), length, count, 0)])
    shared = length // 64 * 64
    pages, table = _paged(keys, values, shared)
    own_k, own_v = keys[:, shared:].copy(), values[:, shared:].copy()
    split = _call(q, k, v, [(own_k, own_v, length, count, 0, 0, table)])
    assert np.array_equal(split, whole)
    assert np.array_equal(own_k[:, length - shared :], k.transpose(1, 0, 2))  # rows stored
    own = keys[:, shared:].copy(), values[:, shared:].copy()
    assert all(np.array_equal(p[0, 0], keys[:, i * 64 : (i + 1) * 64]) for i, p in enumerate(pages))
    # the same row among other sequences' rows, each with its own pages or none
    other_k, other_v = _cache(rng, 70, 80)
    mixed = _call(
        np.concatenate([q[:1], q]),
        np.concatenate([k[:1], k]),
        np.concatenate([v[:1], v]),
        [(other_k, other_v, 70, 1, 0), (*own, length, count, 1, 0, table)],
    )
    assert np.array_equal(mixed[1:], whole)


def test_pages_that_do_not_fit_the_cache_are_refused() -> None:
    rng = np.random.default_rng(4)
    keys, values = _cache(rng, 130, 140)
    _, table = _paged(keys, values, 128)
    q = np.ones((1, H, HD), np.float32)
    k = np.ones((1, HKV, HD), np.float32)
    own = keys[:, 128:].copy(), values[:, 128:].copy()
    for entry in [
        (*own, 100, 1, 0, 0, table),  # rows before the pages' end
        (*own, 130, 1, 0, 0, table[:, :1].copy().reshape(-1)[:1]),  # half a table
        (*own, 130, 1, 0, 64, table),  # a ring has no pages
        (*own, 140, 1, 0, 0, table),  # past its own arrays' room
        (*own, 130, 1, 0, 0, table.view(np.int32)),  # not addresses
    ]:
        with pytest.raises(ValueError):
            _call(q, k, k, [entry])
