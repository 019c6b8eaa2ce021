"""MXFP4 (gpt-oss's weights) on every kernel path: rows equal gguf-py's dequantize bit for
bit, products within float32 rounding of float64 math on those rows, a row's bits the same
alone, anywhere in a batch, at either vector width and thread count, and the q8 kernel
equal to a numpy model of llama.cpp's MXFP4 x Q8_0 dot."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from meshnet.backends import quant
from meshnet.errors import UnsupportedTensorType

NATIVE_BUILT = quant.NATIVE is not None
PATHS = ["numba", "avx2", "best"] if NATIVE_BUILT else ["numba"]
needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="the native kernels are not built")
BLOCK = 17  # bytes of a block of 32: the E8M0 exponent, then 16 bytes of nibbles
COLS = 32 * 12
# Exponent bands (e of each block) and the activations' scale that keeps their sums
# finite in float32: subnormal scales (e < 2), ordinary weights, the largest whose weights
# all fit float32 (12 * 2^(252 - 128); from e = 253 a weight of 12 dequantizes to inf).
BANDS = {"low": ((0, 4), 1.0), "mid": ((110, 140), 1.0), "high": ((246, 253), 1e-34)}


def mxfp4_blocks(rows: int, cols: int, seed: int, exponents: tuple[int, int]) -> np.ndarray:
    """Random GGUF bytes [rows, cols / 32 * 17]: every nibble, exponents in [lo, hi)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 32, BLOCK), dtype=np.uint8)
    blocks[..., 0] = rng.integers(*exponents, (rows, cols // 32))
    blocks[0, 0, 1:] = np.arange(16, dtype=np.uint8) * 17  # each code in both nibbles
    return blocks.reshape(rows, -1)


def _dense(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    with np.errstate(over="ignore"):  # e = 255 times 12 is beyond float32, as in llama.cpp
        return gguf.quants.dequantize(raw, QT.MXFP4).reshape(rows, cols)


def _matrix(
    rows: int, path: str, seed: int = 0, band: str = "mid", q8: bool = False
) -> tuple[quant.QuantMatrix, np.ndarray]:
    """A random MXFP4 matrix for ``path`` (q8: in the q8 layout) and its gguf-py rows."""
    raw = mxfp4_blocks(rows, COLS, seed, BANDS[band][0])
    w = quant.from_blocks(raw, QT.MXFP4, (rows, COLS), native=path != "numba", q8=q8)
    return w, _dense(raw, rows, COLS)


def _x(tokens: int, seed: int, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((tokens, COLS)) * scale).astype(np.float32)


def test_gguf_decodes_mxfp4_as_llama_cpp() -> None:
    """The reference itself: kvalues_mxfp4 (E2M1 doubled) times 2^(e - 128)."""
    kvalues = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float64)
    raw = mxfp4_blocks(3, 64, 9, (0, 256))
    blocks = raw.reshape(-1, BLOCK)
    d = 2.0 ** (blocks[:, 0].astype(np.float64) - 128)
    low, high = kvalues[blocks[:, 1:] & 15], kvalues[blocks[:, 1:] >> 4]
    ref = (np.concatenate([low, high], axis=1) * d[:, None]).astype(np.float32)
    with np.errstate(over="ignore"):
        assert np.array_equal(_dense(raw, 3, 64).reshape(-1, 32), ref)


@pytest.mark.parametrize("path", PATHS[:2])
@pytest.mark.parametrize("band", ["low", "mid", "high"])
def test_rows_are_gguf_dequantized_rows(path: str, band: str) -> None:
    raw = mxfp4_blocks(37, COLS, 4, (0, 256) if band == "high" else BANDS[band][0])
    w = quant.from_blocks(raw, QT.MXFP4, (37, COLS), native=path != "numba")
    dense = _dense(raw, 37, COLS)
    ids = np.array([36, 0, 17, 17, 16, 15, 31, 32])
    with np.errstate(over="ignore"):
        assert np.array_equal(quant.dequantize_rows(w, ids), dense[ids])
        assert np.array_equal(quant.dequantize_all(w), dense)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("band", list(BANDS))
def test_matmul_is_dequantized_math(path: str, band: str) -> None:
    """Within float32 rounding of each output's sum of |w| |x|, subnormal block scales and
    the largest ones included (e = 255 aside: its weights of 12 are beyond float32)."""
    w, dense = _matrix(40, path, band=band)
    x = _x(9, 0, BANDS[band][1])
    exact = x.astype(np.float64) @ dense.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(dense).T.astype(np.float64)
    assert np.all(np.abs(quant.matmul(x, w, wide=path == "best") - exact) <= 1e-5 * scale)


@pytest.mark.parametrize("path", PATHS + [f"q8-{p}" for p in PATHS[1:]])
@pytest.mark.parametrize("rows", [61, 7])  # whole and partial row groups, a part vector
def test_a_row_gets_the_same_bits_in_any_batch(path: str, rows: int) -> None:
    q8 = path.startswith("q8-")
    path = path.removeprefix("q8-")
    w, _ = _matrix(rows, path, seed=rows, q8=q8)
    assert w.q8 == q8
    x = _x(40, 2)
    wide = path == "best"
    alone = np.concatenate([quant.matmul(x[i : i + 1], w, wide=wide) for i in range(40)])
    for batch in (2, 3, 4, 5, 8, 12, 13, 16, 17, 33, 40):
        assert np.array_equal(quant.matmul(x[:batch], w, wide=wide), alone[:batch])
        assert np.array_equal(quant.matmul(x[40 - batch :], w, wide=wide), alone[40 - batch :])


@needs_native
@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8"])
def test_widths_and_thread_counts_give_the_same_bits(q8: bool) -> None:
    """AVX2's 8-row vectors and AVX-512's 16-row ones, 1 or 2 threads: the same bits."""
    w, _ = _matrix(93, "best", seed=3, q8=q8)
    packed, rows, nb, code = quant.native_args(w)
    x = _x(32, 3)
    for batch in (1, 4, 7, 20, 32):
        outs = []
        for threads in (1, 2):
            for wide in (False, True):
                out = np.empty((batch, rows), np.float32)
                quant.NATIVE.matmul(packed, x[:batch], out, rows, nb, batch, code, threads, wide)
                outs.append(out)
        assert all(np.array_equal(outs[0], o) for o in outs[1:])


def _q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x's rows as ggml's x86 quantize_row_q8_0 makes them: per block of 32 d = amax / 127
    as float16 and q = round-half-even(x * 127 / amax), both computed in float32."""
    f32 = np.float32
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2)
    safe = np.where(amax == 0, f32(1), amax)
    inv = np.where(amax == 0, f32(0), f32(127) / safe).astype(f32)
    q = np.rint((blocks * inv[..., None]).astype(f32)).astype(np.int64)
    d = (amax / f32(127)).astype(f32).astype(np.float16).astype(f32)
    return q, d


def _llama_q8_dot(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """llama.cpp's MXFP4 x Q8_0 arithmetic, one float32 chain per (row, token): per block
    in order acc = fma(d_w d_x, sum of k q, acc), k the weights' E2M1 values doubled and
    d_w = 2^(e - 128). fma is exact in float64 here, then rounded once to float32 (the
    double rounding could differ in a tie of a tie; the seeds below have none)."""
    kvalues = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK)
    k = np.concatenate([kvalues[blocks[..., 1:] & 15], kvalues[blocks[..., 1:] >> 4]], axis=2)
    dw = (2.0 ** (blocks[..., 0].astype(np.float64) - 128)).astype(np.float32)
    q, dx = _q8_0(x)
    isum = np.einsum("rbi,tbi->trb", k, q)  # exact integers
    dd = (dw[None, :, :] * dx[:, None, :]).astype(np.float32)  # float32 products
    acc = np.zeros((x.shape[0], rows), np.float32)
    for b in range(blocks.shape[1]):
        acc = (dd[:, :, b].astype(np.float64) * isum[:, :, b] + acc).astype(np.float32)
    return acc


@needs_native
@pytest.mark.parametrize("band", ["low", "mid"])
def test_q8_kernel_is_llama_cpp_arithmetic(band: str) -> None:
    raw = mxfp4_blocks(45, COLS, 7, BANDS[band][0])
    w = quant.from_blocks(raw, QT.MXFP4, (45, COLS), q8=True)
    assert w.q8  # the q8 layout, not the float32 kernels' fallback
    x = _x(9, 8)
    x[0, :32] = 0.0  # an all-zero block quantizes to zeros
    want = _llama_q8_dot(raw, x)
    for wide in (False, True):
        assert np.array_equal(quant.matmul(x, w, wide=wide), want)


@needs_native
def test_q8_layout_rows_are_gguf_dequantized_rows() -> None:
    w, dense = _matrix(37, "best", seed=6, q8=True)
    assert np.array_equal(quant.dequantize_all(w), dense)


@needs_native
@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8"])
def test_a_native_matrix_holds_its_gguf_bytes(q8: bool) -> None:
    """Whole groups of 16 rows take exactly the GGUF's bytes, which are not kept."""
    raw = mxfp4_blocks(64, COLS, 10, BANDS["mid"][0])
    w = quant.from_blocks(raw, QT.MXFP4, (64, COLS), q8=q8)
    assert w.data.nbytes == raw.nbytes and not np.shares_memory(w.data, raw)


@pytest.mark.parametrize("native", [False, True] if NATIVE_BUILT else [False])
def test_a_width_or_size_mxfp4_cannot_hold_is_refused(native: bool) -> None:
    with pytest.raises(UnsupportedTensorType):  # 48 weights: not whole blocks of 32
        quant.from_blocks(np.zeros(4 * 2 * BLOCK, np.uint8), QT.MXFP4, (4, 48), native=native)
    with pytest.raises(UnsupportedTensorType):  # a byte short of 4 rows of 64
        quant.from_blocks(np.zeros(4 * 2 * BLOCK - 1, np.uint8), QT.MXFP4, (4, 64), native=native)
