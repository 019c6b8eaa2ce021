"""The native attention tiled over the keys (tiles of 64 positions at fixed boundaries):
at lengths around the tile edges and windows it equals the float64 reference, and a row's
bits do not depend on how its prompt is chunked, what shares its call, or how many threads
run it (one long row's tiles spread over the threads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from by_isa import outputs_by_isa

from meshnet.model.layers import causal_attention

native = pytest.importorskip("meshnet.backends._native")

H, HKV, HD = 4, 2, 16
LENGTHS = [1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 320, 513]


def _inputs(length: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((length, H, HD)).astype(np.float32)
    k = rng.standard_normal((length, HKV, HD)).astype(np.float32)
    v = rng.standard_normal((length, HKV, HD)).astype(np.float32)
    return q, k, v


def _run(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    chunks: list[int],
    threads: int,
    window: int = 0,
    softcap: float = 0.0,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """One sequence's rows fed in ``chunks`` (sizes summing to its length), each chunk one
    call that stores its keys and values and attends; every row's output."""
    length = q.shape[0]
    keys = np.zeros((HKV, length, HD), np.float32)
    values = np.zeros((HKV, length, HD), np.float32)
    outs, first = [], 0
    for n in chunks:
        rows = slice(first, first + n)
        out = np.empty((n, H * HD), np.float32)
        args = (q[rows].copy(), k[rows].copy(), v[rows].copy(), out)
        entry = [(keys, values, first, n, 0)]
        native.attend(*args, entry, n, H, HKV, HD, threads, HD**-0.5, softcap, window, sinks)
        outs.append(out)
        first += n
    return np.concatenate(outs)


def _reference(q, k, v, window=0, softcap=0.0, sinks=None) -> np.ndarray:  # type: ignore[no-untyped-def]
    keys = k.transpose(1, 0, 2).astype(np.float64)
    values = v.transpose(1, 0, 2).astype(np.float64)
    out = causal_attention(q.astype(np.float64), keys, values, 0, HD**-0.5, softcap, window, sinks)
    return out.reshape(q.shape[0], H * HD)


@pytest.mark.parametrize("window", [0, 64, 100])
@pytest.mark.parametrize("length", LENGTHS)
def test_tiles_equal_the_reference_and_give_the_same_bits_however_chunked(
    length: int, window: int
) -> None:
    q, k, v = _inputs(length, length + window)
    whole = _run(q, k, v, [length], threads=2, window=window)
    assert np.allclose(whole, _reference(q, k, v, window), atol=2e-5)
    for size in (5, 64, 65):
        chunks = [size] * (length // size) + ([length % size] if length % size else [])
        assert np.array_equal(_run(q, k, v, chunks, threads=2, window=window), whole)
    one_thread = _run(q, k, v, [length], threads=1, window=window)
    assert np.array_equal(one_thread, whole)
    # the last rows decoded one at a time: a lone long row's tiles shared by the threads
    tail = min(length, 3)
    steps = [length - tail] * (length > tail) + [1] * tail
    for threads in (1, 2, 3):
        assert np.array_equal(_run(q, k, v, steps, threads=threads, window=window), whole)


@pytest.mark.parametrize("window", [0, 300])
def test_a_long_prompt_gets_its_bits_whatever_rows_share_its_units(window: int) -> None:
    """A long prompt's rows share each key tile in units of up to 64 rows (fewer where a
    call has few rows for its threads): the unit a row falls in never moves its bits."""
    length = 1500
    q, k, v = _inputs(length, 11 + window)
    whole = _run(q, k, v, [length], threads=2, window=window)
    assert np.allclose(whole, _reference(q, k, v, window), atol=2e-5)
    calls = ([length], 1), ([length], 3), ([128] * 11 + [92], 2), ([37] * 40 + [20], 2)
    for chunks, threads in calls:
        assert np.array_equal(_run(q, k, v, chunks, threads=threads, window=window), whole)


@pytest.mark.parametrize("length", [130, 600])
def test_soft_cap_and_sinks_keep_the_contract(length: int) -> None:
    q, k, v = _inputs(length, 7)
    q *= 4  # scores large enough for the cap and the tile maxima to matter
    sinks = np.array([0.5, -1.0, 3.0, 20.0], np.float32)
    whole = _run(q, k, v, [length], threads=2, softcap=2.0, sinks=sinks)
    expect = _reference(q, k, v, softcap=2.0, sinks=sinks.astype(np.float64))
    assert np.allclose(whole, expect, atol=2e-5)
    steps = [length - 2, 1, 1]
    for threads in (1, 2):
        got = _run(q, k, v, steps, threads=threads, softcap=2.0, sinks=sinks)
        assert np.array_equal(got, whole)


def test_a_long_row_beside_others_gets_its_bits_alone() -> None:
    length = 700
    q, k, v = _inputs(length, 3)
    alone = _run(q, k, v, [length - 1, 1], threads=2)[-1]
    keys = np.zeros((HKV, length, HD), np.float32)
    values = np.zeros((HKV, length, HD), np.float32)
    keys[:, : length - 1] = k[:-1].transpose(1, 0, 2)
    values[:, : length - 1] = v[:-1].transpose(1, 0, 2)
    rng = np.random.default_rng(4)
    other = [np.zeros((HKV, 80, HD), np.float32) for _ in range(2)]
    qq = np.concatenate([rng.standard_normal((9, H, HD)).astype(np.float32), q[-1:]])
    kk = np.concatenate([rng.standard_normal((9, HKV, HD)).astype(np.float32), k[-1:]])
    vv = np.concatenate([rng.standard_normal((9, HKV, HD)).astype(np.float32), v[-1:]])
    out = np.empty((10, H * HD), np.float32)
    entries = [(other[0], other[1], 70, 9, 0), (keys, values, length - 1, 1, 9)]
    native.attend(qq, kk, vv, out, entries, 10, H, HKV, HD, 2)
    assert np.array_equal(out[9], alone)


@pytest.mark.parametrize("window", [64, 100])
def test_a_ring_of_the_window_gives_the_bits_of_the_whole_cache(window: int) -> None:
    length, ring = 700, 256  # the ring goes round twice; it holds window + 65 - 1 and more
    q, k, v = _inputs(length, window)
    whole = _run(q, k, v, [65] * 10 + [1] * 50, threads=2, window=window)
    keys = np.zeros((HKV, ring, HD), np.float32)
    values = np.zeros((HKV, ring, HD), np.float32)
    outs, first = [], 0
    for n in [65] * 10 + [1] * 50:
        rows = slice(first, first + n)
        out = np.empty((n, H * HD), np.float32)
        entry = [(keys, values, first, n, 0, ring)]
        native.attend(q[rows], k[rows], v[rows], out, entry, n, H, HKV, HD, 2, HD**-0.5, 0, window)
        outs.append(out)
        first += n
    assert np.array_equal(np.concatenate(outs), whole)
    last = length - 1  # position p is in slot p % ring
    assert np.array_equal(keys[:, last % ring], k[last])


@pytest.mark.parametrize(
    "entry",
    [
        (np.zeros((HKV, 100, HD), np.float32), 200, 1, 100),  # going round: not whole tiles
        (np.zeros((HKV, 128, HD), np.float32), 200, 80, 128),  # rows reading a slot they write
        (np.zeros((HKV, 128, HD), np.float32), 0, 1, 64),  # a ring that is not the array
    ],
)
def test_a_ring_that_cannot_hold_the_rows_is_refused(entry) -> None:  # type: ignore[no-untyped-def]
    keys, first, count, ring = entry
    q = np.ones((count, H, HD), np.float32)
    k = np.ones((count, HKV, HD), np.float32)
    out = np.empty((count, H * HD), np.float32)
    entries = [(keys, keys.copy(), first, count, 0, ring)]
    with pytest.raises(ValueError):
        native.attend(q, k, k, out, entries, count, H, HKV, HD, 2, HD**-0.5, 0, 64)
    assert not keys.any()


def test_the_reference_in_blocks_of_rows_equals_it_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshnet.model import layers

    q, k, v = _inputs(300, 9)
    whole = _reference(q, k, v, window=100)
    monkeypatch.setattr(layers, "ROWS", 64)
    assert np.allclose(_reference(q, k, v, window=100), whole, atol=1e-12)


@pytest.mark.parametrize("group", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("hd", [8, 24, 64, 104])
def test_a_query_heads_bits_do_not_depend_on_the_heads_beside_it(group: int, hd: int) -> None:
    """The query heads of one KV head share each key and value load (up to four at a time,
    several column widths of the values): each head's output is the bits it gets alone."""
    length = 150
    rng = np.random.default_rng(group * 1000 + hd)
    q = rng.standard_normal((length, group, hd)).astype(np.float32)
    k = rng.standard_normal((length, 1, hd)).astype(np.float32)
    v = rng.standard_normal((length, 1, hd)).astype(np.float32)

    def attend(heads: np.ndarray) -> np.ndarray:
        n = heads.shape[1]
        keys = np.zeros((1, length, hd), np.float32)
        values = np.zeros((1, length, hd), np.float32)
        out = np.empty((length, n * hd), np.float32)
        entry = [(keys, values, 0, length, 0)]
        native.attend(heads.copy(), k, v, out, entry, length, n, 1, hd, 2, hd**-0.5, 0, 100)
        return out.reshape(length, n, hd)

    together = attend(q)
    keys = k.transpose(1, 0, 2).astype(np.float64)
    values = v.transpose(1, 0, 2).astype(np.float64)
    expect = causal_attention(q.astype(np.float64), keys, values, 0, hd**-0.5, 0.0, 100, None)
    assert np.allclose(together.reshape(length, -1), expect.reshape(length, -1), atol=2e-5)
    for x in range(group):
        assert np.array_equal(attend(q[:, x : x + 1])[:, 0], together[:, x])


_BY_ISA = """
import sys
import numpy as np
from meshnet.backends import _native as native
rng = np.random.default_rng(5)
T, H, HKV, HD = 200, 8, 2, 104  # four heads a group: AVX-512's value blocks where it runs
q = rng.standard_normal((T, H, HD)).astype(np.float32)
k = rng.standard_normal((T, HKV, HD)).astype(np.float32)
v = rng.standard_normal((T, HKV, HD)).astype(np.float32)
keys, values = np.zeros((HKV, T, HD), np.float32), np.zeros((HKV, T, HD), np.float32)
out = np.empty((T, H * HD), np.float32)
native.attend(q, k, v, out, [(keys, values, 0, T, 0)], T, H, HKV, HD, 2)
np.save(sys.argv[1], out)
"""


def test_the_avx2_and_widest_vectors_give_the_same_bits(tmp_path: Path) -> None:
    outs = outputs_by_isa(_BY_ISA, tmp_path)
    assert np.array_equal(outs[0], outs[1])
