"""A float16 KV cache in the native attention (the q8-kv16 backend's): a call stores its new
keys and values rounded to float16 as numpy rounds them, and reads them widened, so its
rows are the bits of a float32 cache holding those rounded values, at every length around
the tile edges and windows, in rings and pages, however chunked, threaded or batched, on
AVX2 and the widest vectors; a cache of mixed or other types is refused unwritten."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from by_isa import outputs_by_isa

native = pytest.importorskip("meshnet.backends._native")

# (query heads, kv heads, head dim): pairs of queries (AVX2's path), four per kv head (the
# 16-lane scores on AVX-512 and the decode tiles' four-query pass) and Gemma 3's 256 wide
SHAPES = [(4, 2, 16), (8, 2, 64), (4, 1, 256), (3, 1, 24)]
LENGTHS = [1, 63, 64, 65, 129, 257, 513]


def _inputs(length: int, shape: tuple[int, int, int], seed: int) -> tuple[np.ndarray, ...]:
    h, hkv, hd = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((length, h, hd)).astype(np.float32)
    k = rng.standard_normal((length, hkv, hd)).astype(np.float32)
    v = rng.standard_normal((length, hkv, hd)).astype(np.float32)
    return q, k, v


def _rounded(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _run(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    chunks: list[int],
    dtype: type[np.floating],
    threads: int = 2,
    window: int = 0,
    ring: int = 0,
    softcap: float = 0.0,
    sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sequence's rows fed in ``chunks``, a call each, into a cache of ``dtype``
    (a ring of ``ring`` slots where given): every row's output, and the cache."""
    length, h, hd = q.shape
    hkv = k.shape[1]
    keys = np.zeros((hkv, ring or length, hd), dtype)
    values = np.zeros_like(keys)
    outs, first = [], 0
    for n in chunks:
        rows = slice(first, first + n)
        out = np.empty((n, h * hd), np.float32)
        entry = [(keys, values, first, n, 0, ring)]
        args = (q[rows].copy(), k[rows].copy(), v[rows].copy(), out, entry, n, h, hkv, hd)
        native.attend(*args, threads, hd**-0.5, softcap, window, sinks)
        outs.append(out)
        first += n
    return np.concatenate(outs), keys, values


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("length", LENGTHS)
def test_a_half_cache_gives_the_bits_of_a_float32_cache_of_its_rounded_values(
    length: int, window: int, shape: tuple[int, int, int]
) -> None:
    q, k, v = _inputs(length, shape, length + window)
    half, keys, values = _run(q, k, v, [length], np.float16, window=window)
    assert keys.dtype == np.float16
    assert np.array_equal(
        keys.view(np.uint16), k.transpose(1, 0, 2).astype(np.float16).view(np.uint16)
    )
    assert np.array_equal(
        values.view(np.uint16), v.transpose(1, 0, 2).astype(np.float16).view(np.uint16)
    )
    wide, _, _ = _run(q, _rounded(k), _rounded(v), [length], np.float32, window=window)
    assert np.array_equal(half, wide)
    # and the same bits however the prompt is fed: chunks, one thread, decode rows
    tail = min(length - 1, 3)
    for chunks in ([5] * (length // 5) + [length % 5], [length - tail] + [1] * tail):
        got, _, _ = _run(q, k, v, [c for c in chunks if c], np.float16, window=window)
        assert np.array_equal(got, half)
    assert np.array_equal(_run(q, k, v, [length], np.float16, 1, window)[0], half)


def test_rounding_to_half_is_numpys_at_ties_subnormals_and_overflow() -> None:
    specials = np.array(
        [1 + 2**-11, 1 + 3 * 2**-11, 2**-24, 2**-25, 3 * 2**-26, 65504, 65520, -65536, 0.0, -0.0],
        np.float32,
    )
    k = np.resize(specials, (1, 1, 16)).astype(np.float32)
    q = np.zeros((1, 1, 16), np.float32)
    _, keys, values = _run(q, k, k.copy(), [1], np.float16)
    with np.errstate(over="ignore"):  # past float16's largest: infinity, as numpy gives
        want = k[0, 0].astype(np.float16)
    assert np.array_equal(keys[0, 0].view(np.uint16), want.view(np.uint16))
    assert np.array_equal(values.view(np.uint16), keys.view(np.uint16))


@pytest.mark.parametrize("window", [64, 100])
def test_a_half_ring_of_the_window_gives_the_bits_of_the_whole_half_cache(window: int) -> None:
    q, k, v = _inputs(700, (4, 1, 256), window)
    chunks = [65] * 10 + [1] * 50
    whole, _, _ = _run(q, k, v, chunks, np.float16, window=window)
    ring, keys, _ = _run(q, k, v, chunks, np.float16, window=window, ring=256)
    assert np.array_equal(ring, whole)
    assert np.array_equal(keys[:, 699 % 256], k[699].astype(np.float16))


def test_soft_cap_and_sinks_on_a_half_cache() -> None:
    q, k, v = _inputs(300, (4, 2, 16), 9)
    q *= 4
    sinks = np.array([0.5, -1.0, 3.0, 20.0], np.float32)
    cap = dict(softcap=2.0, sinks=sinks)
    half, _, _ = _run(q, k, v, [298, 1, 1], np.float16, **cap)  # type: ignore[arg-type]
    wide, _, _ = _run(q, _rounded(k), _rounded(v), [298, 1, 1], np.float32, **cap)  # type: ignore[arg-type]
    assert np.array_equal(half, wide)


def test_half_pages_give_the_bits_of_one_half_array() -> None:
    h, hkv, hd = 8, 2, 64
    length, count, shared = 300, 5, 256
    q, k, v = _inputs(length + count, (h, hkv, hd), 11)
    whole, keys, values = _run(q, k, v, [length, count], np.float16)
    pages = [np.zeros((1, 2, hkv, 64, hd), np.float16) for _ in range(shared // 64)]
    for i, page in enumerate(pages):
        page[0, 0] = keys[:, i * 64 : (i + 1) * 64]
        page[0, 1] = values[:, i * 64 : (i + 1) * 64]
    table = np.array([[p[0, 0].ctypes.data for p in pages], [p[0, 1].ctypes.data for p in pages]])
    own_k = np.zeros((hkv, length + count - shared, hd), np.float16)
    own_v = np.zeros_like(own_k)
    own_k[:, : length - shared] = keys[:, shared:length]
    own_v[:, : length - shared] = values[:, shared:length]
    rows = slice(length, length + count)
    out = np.empty((count, h * hd), np.float32)
    entry = [(own_k, own_v, length, count, 0, 0, table)]
    native.attend(q[rows], k[rows], v[rows], out, entry, count, h, hkv, hd, 2)
    assert np.array_equal(out, whole[length:])
    assert np.array_equal(own_k[:, length - shared :], keys[:, length:])


@pytest.mark.parametrize(
    ("key_type", "value_type"),
    [
        (np.float16, np.float32),
        (np.float32, np.float16),
        (np.float64, np.float64),
        (np.int16, np.int16),
    ],
)
def test_a_cache_of_mixed_or_other_types_is_refused_unwritten(key_type, value_type) -> None:  # type: ignore[no-untyped-def]
    q, k, v = _inputs(3, (4, 2, 16), 1)
    keys, values = np.zeros((2, 8, 16), key_type), np.zeros((2, 8, 16), value_type)
    out = np.empty((3, 64), np.float32)
    with pytest.raises(ValueError, match="float32 or float16"):
        native.attend(q, k, v, out, [(keys, values, 0, 3, 0)], 3, 4, 2, 16, 2)
    assert not keys.any() and not values.any()


_BY_ISA = """
import sys
import numpy as np
sys.path[:0] = [{tests!r}, {helpers!r}]
from test_half_kv import SHAPES, _inputs, _run
outs = []
for shape in SHAPES:
    q, k, v = _inputs(333, shape, 5)
    outs.append(_run(q, k, v, [200, 130, 1, 1, 1], np.float16, window=0)[0].ravel())
    outs.append(_run(q, k, v, [65] * 5 + [8], np.float16, window=100, ring=256)[0].ravel())
np.save(sys.argv[1], np.concatenate(outs))
"""


def test_the_avx2_and_widest_vectors_give_a_half_cache_the_same_bits(tmp_path: Path) -> None:
    here = Path(__file__).parent
    outs = outputs_by_isa(_BY_ISA.format(tests=str(here), helpers=str(here.parent)), tmp_path)
    assert np.array_equal(outs[0], outs[1])
