"""The q8 matmul (8-bit activations, integer dot products) for every type it takes:
against float64 math on gguf-py's dequantized weights and the same 8-bit activations
(tight), against float32 activations (loose), bit-identical for a row alone or anywhere
in a batch at either vector width and thread count, embedding rows from its layout
equal to gguf-py's, and the types without a q8 kernel kept in the float32 layout."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from kquants import quantize as k_quantize

from meshnet.backends import quant

pytestmark = pytest.mark.skipif(quant.NATIVE is None, reason="the native kernels are not built")

Q8_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K]
K_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
COLS = 512  # two super-blocks


def _gguf_bytes(data: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return data.view(np.uint8)
    if qtype == QT.F16:
        return data.astype(np.float16).view(np.uint8)
    if qtype in (*K_TYPES, QT.Q2_K):
        return k_quantize(data, qtype)
    return gguf.quants.quantize(data, qtype)


def _matrix(qtype: QT, rows: int, seed: int = 0) -> tuple[quant.QuantMatrix, np.ndarray]:
    """A random matrix in the q8 layout and its gguf-py dequantization (float64)."""
    data = np.random.default_rng(seed).standard_normal((rows, COLS)).astype(np.float32) * 0.2
    raw = _gguf_bytes(data, qtype)
    w = quant.from_blocks(raw, qtype, (rows, COLS), q8=True)
    dense = gguf.quants.dequantize(raw, qtype).reshape(rows, COLS).astype(np.float64)
    return w, dense


def _x(tokens: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((tokens, COLS)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block quantizes to zeros
    return x


def _f16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float64)


def quantized_x(x: np.ndarray, qtype: QT) -> np.ndarray:
    """x as the kernels quantize it, back in float64: ggml's Q8_0/Q8_1 (d = amax / 127 as
    float16, q = round-half-even(x * 127 / amax)) or Q8_K (d = max / -127 for the value of
    largest magnitude, q = min(127, round-half-even(x * -127 / max)))."""
    f32 = np.float32
    if qtype in K_TYPES:
        blocks = x.reshape(-1, 256)
        idx = np.argmax(np.abs(blocks), axis=1)  # the first of largest magnitude
        big = blocks[np.arange(len(blocks)), idx]
        safe = np.where(big == 0, f32(1), big)
        iscale = (f32(-127.0) / safe).astype(f32)
        q = np.minimum(np.rint((iscale[:, None] * blocks).astype(f32)), 127)
        d = np.where(big == 0, 0.0, (f32(1) / iscale).astype(f32)).astype(np.float64)
        return (q * d[:, None]).reshape(x.shape)
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    ids = np.where(amax == 0, f32(0), f32(127.0) / np.where(amax == 0, f32(1), amax)).astype(f32)
    q = np.rint((blocks * ids[:, None]).astype(f32))
    d = _f16((amax / f32(127.0)).astype(f32))
    return (q * d[:, None]).reshape(x.shape)


def _offset_correction(x: np.ndarray, raw_m: np.ndarray) -> np.ndarray:
    """Q4_1's and Q5_1's offsets meet llama.cpp's s = float16(d_x * sum q) rather than sum of the
    quantized x: the difference per (row, token), to add to the float64 product."""
    f32 = np.float32
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2)
    ids = np.where(amax == 0, f32(0), f32(127.0) / np.where(amax == 0, f32(1), amax)).astype(f32)
    q = np.rint((blocks * ids[..., None]).astype(f32))
    d32 = (amax / f32(127.0)).astype(f32)
    s = _f16((d32 * q.sum(axis=2)).astype(f32))  # [T, nb]
    exact = _f16(d32) * q.sum(axis=2)
    return (s - exact) @ raw_m.T  # [T, rows]


def _offsets(qtype: QT, rows: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).standard_normal((rows, COLS)).astype(np.float32) * 0.2
    raw = _gguf_bytes(data, qtype).reshape(rows, -1, 20 if qtype == QT.Q4_1 else 24)
    return raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)  # [rows, nb]


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("wide", [False, True])
def test_q8_matmul_is_float64_math_on_the_same_8_bit_activations(qtype: QT, wide: bool) -> None:
    """Within 1e-5 of each output's sum of |w| |x_q| (the float32 combination of exact
    integer block sums)."""
    w, dense = _matrix(qtype, 45, seed=2)
    x = _x(5)
    assert w.q8
    xq = quantized_x(x, qtype)
    want = xq @ dense.T
    if qtype in (QT.Q4_1, QT.Q5_1):
        want += _offset_correction(x, _offsets(qtype, 45, 2))
    got = quant.matmul(x, w, wide=wide)
    bound = 1e-5 * (np.abs(xq) @ np.abs(dense).T) + 1e-30
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda q: q.name)
def test_q8_matmul_is_near_float32_activations(qtype: QT) -> None:
    """8-bit activations move each input by at most half a step (amax / 127): every output
    within 1% of its sum of |w| |x|, and on Gaussian inputs an error of 1.5% rms of the
    outputs at most (measured: 0.53% for blocks of 32, 0.70% for Q8_K's 256)."""
    w, dense = _matrix(qtype, 256, seed=3)
    x = _x(8, seed=4)
    x[0, :32] = np.random.default_rng(5).standard_normal(32)
    got = quant.matmul(x, w)
    want = x.astype(np.float64) @ dense.T
    bound = 0.01 * (np.abs(x).astype(np.float64) @ np.abs(dense).T)
    assert np.all(np.abs(got - want) <= bound)
    assert np.sqrt(np.mean((got - want) ** 2)) <= 0.015 * np.sqrt(np.mean(want**2))


@pytest.mark.parametrize("rows", [61, 37], ids=["even-vectors", "odd-vectors"])
@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda q: q.name)
def test_q8_rows_are_the_same_alone_batched_wide_or_threaded(qtype: QT, rows: int) -> None:
    """Whole and partial row groups, a part vector; 37 rows are five AVX2 vectors, so a
    batch tile of two row vectors (q8_avx2.h's Q8_0 pairs_tile) leaves one alone."""
    w, _ = _matrix(qtype, rows, seed=5)
    x = _x(27, seed=6)
    packed, _, nb, code = quant.native_args(w)
    alone = np.concatenate([quant.matmul(x[i : i + 1], w, wide=False) for i in range(27)])
    for batch in (1, 2, 3, 4, 5, 8, 12, 13, 27):
        for wide in (False, True):
            for threads in (1, 2):
                out = np.empty((batch, rows), np.float32)
                quant.NATIVE.matmul(packed, x[:batch], out, rows, nb, batch, code, threads, wide)
                assert np.array_equal(out, alone[:batch]), (batch, wide, threads)


@pytest.mark.parametrize(
    "qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0], ids=lambda q: q.name
)
def test_q8_rows_of_18_blocks_are_the_same_alone_and_batched(qtype: QT) -> None:
    """576 columns (the bundled model's width) are 18 blocks of 32: AVX2's nibble_rows
    makes its sums 8 blocks at a time (q8_avx2.h), so the last chunk is a part one."""
    rows, cols = 45, 576
    data = np.random.default_rng(14).standard_normal((rows, cols)).astype(np.float32) * 0.2
    w = quant.from_blocks(gguf.quants.quantize(data, qtype), qtype, (rows, cols), q8=True)
    x = np.random.default_rng(15).standard_normal((17, cols)).astype(np.float32)
    packed, _, nb, code = quant.native_args(w)
    alone = np.concatenate([quant.matmul(x[i : i + 1], w, wide=False) for i in range(17)])
    for batch in (2, 3, 4, 8, 9, 17):
        for wide in (False, True):
            for threads in (1, 2):
                out = np.empty((batch, rows), np.float32)
                quant.NATIVE.matmul(packed, x[:batch], out, rows, nb, batch, code, threads, wide)
                assert np.array_equal(out, alone[:batch]), (batch, wide, threads)


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda q: q.name)
def test_q8_rows_of_a_long_batch_are_the_same_in_its_blocks_of_tokens(qtype: QT) -> None:
    """A batch of hundreds of tokens runs in blocks of tokens (384 at these 512 columns):
    a token's outputs are what it gets alone, whichever block it falls in, at either
    vector width and thread count."""
    rows, tokens = 45, 800  # blocks of 384, 384 and 32
    w, _ = _matrix(qtype, rows, seed=8)
    x = np.random.default_rng(9).standard_normal((tokens, COLS)).astype(np.float32)
    packed, _, nb, code = quant.native_args(w)
    alone = np.concatenate([quant.matmul(x[i : i + 1], w, wide=False) for i in range(tokens)])
    for wide in (False, True):
        for threads in (1, 2, 3):
            out = np.empty((tokens, rows), np.float32)
            quant.NATIVE.matmul(packed, x, out, rows, nb, tokens, code, threads, wide)
            assert np.array_equal(out, alone), (wide, threads)


@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda q: q.name)
def test_q8_layout_rows_are_gguf_dequantized_rows(qtype: QT) -> None:
    w, dense = _matrix(qtype, 37, seed=7)
    ids = np.array([36, 0, 17, 17, 16, 15, 31, 32])
    assert np.array_equal(quant.dequantize_rows(w, ids), dense[ids].astype(np.float32))


def test_q8_layout_holds_the_same_bytes_as_the_float32_one() -> None:
    for qtype in Q8_TYPES:
        data = np.random.default_rng(8).standard_normal((64, COLS)).astype(np.float32)
        raw = _gguf_bytes(data, qtype)
        fast = quant.from_blocks(raw, qtype, (64, COLS))
        q8 = quant.from_blocks(raw, qtype, (64, COLS), q8=True)
        assert q8.q8 and not fast.q8 and q8.data.nbytes == fast.data.nbytes


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.F16, QT.F32], ids=lambda q: q.name)
def test_types_without_a_q8_kernel_keep_the_float32_kernels(qtype: QT) -> None:
    data = np.random.default_rng(9).standard_normal((20, COLS)).astype(np.float32)
    raw = _gguf_bytes(data, qtype)
    w = quant.from_blocks(raw, qtype, (20, COLS), q8=True)
    fast = quant.from_blocks(raw, qtype, (20, COLS))
    x = _x(2)
    assert not w.q8 and np.array_equal(quant.matmul(x, w), quant.matmul(x, fast))


def test_a_q8_0_matrix_holding_minus_128_keeps_the_float32_kernels() -> None:
    data = np.random.default_rng(10).standard_normal((16, COLS)).astype(np.float32)
    raw = gguf.quants.quantize(data, QT.Q8_0).reshape(16, -1, 34).copy()
    raw[3, 2, 2 + 5] = 0x80  # a quant of -128, as llama.cpp's quantizer never writes
    w = quant.from_blocks(raw.reshape(-1), QT.Q8_0, (16, COLS), q8=True)
    assert not w.q8


def test_a_q8_code_for_a_type_without_a_q8_kernel_is_refused() -> None:
    w, _ = _matrix(QT.Q4_0, 16)
    packed, rows, nb, _ = quant.native_args(w)
    out = np.empty((1, rows), np.float32)
    x = _x(1)
    with pytest.raises(ValueError):
        quant.NATIVE.matmul(packed, x, out, rows, nb, 1, 6 | 32, 1)  # Q2_K in the q8 layout
