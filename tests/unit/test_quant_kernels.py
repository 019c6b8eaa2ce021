"""Every kernel path (numba always; the native kernels with AVX2's 8-row vectors and at
their widest, 16 rows with AVX-512, where built) against dequantized math, and
bit-identical for a row alone or anywhere in a batch; the two native widths agree bit
for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from meshnet.backends import quant
from meshnet.model.gguf_file import open_gguf

# numba; the native kernels with AVX2 vectors; the native kernels at their widest
PATHS = ["numba", "avx2", "best"] if quant.kernel_name() == "avx2" else ["numba"]


def _matmul(x: np.ndarray, w: quant.QuantMatrix, path: str) -> np.ndarray:
    return quant.matmul(x, w, native=path != "numba", wide=path == "best")


@pytest.fixture(scope="module", params=[QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda q: q.name)
def matrix(request, tiny_factory) -> quant.QuantMatrix:  # type: ignore[no-untyped-def]
    f = open_gguf(tiny_factory(f"k{request.param.name}.gguf", matrix_type=request.param))
    t = f.tensors["blk.0.ffn_down.weight"]
    w = quant.from_gguf(f, t, (64, 128))
    assert w.kind == ("q8" if request.param == QT.Q8_0 else "q4")
    return w


@pytest.mark.parametrize("path", PATHS)
def test_kernels_match_dequantized_math(matrix: quant.QuantMatrix, path: str) -> None:
    x = np.random.default_rng(0).standard_normal((9, matrix.cols)).astype(np.float32)
    dense = quant.dequantize_all(matrix)
    assert np.allclose(_matmul(x, matrix, path), x @ dense.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_a_row_is_bit_identical_alone_and_at_any_place_in_a_batch(
    matrix: quant.QuantMatrix, path: str
) -> None:
    x = np.random.default_rng(1).standard_normal((9, matrix.cols)).astype(np.float32)
    alone = np.concatenate([_matmul(x[i : i + 1], matrix, path) for i in range(9)])
    for batch in range(1, 10):  # full tiles of four rows, and every tail length
        assert np.array_equal(_matmul(x[:batch], matrix, path), alone[:batch])


def _first_rows(w: quant.QuantMatrix, n: int) -> quant.QuantMatrix:
    """The matrix's first ``n`` rows, as its own matrix."""
    return dataclasses.replace(w, rows=n, raw=w.raw[:n])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [64, 61, 7, 1])
def test_every_tile_shape_gives_a_row_the_same_bits(
    matrix: quant.QuantMatrix, path: str, rows: int
) -> None:
    """Batches the kernels split into register tiles of every width (and partial row
    groups) give each token exactly what it gets alone, and the dequantized math."""
    w = _first_rows(matrix, rows)
    x = np.random.default_rng(2).standard_normal((40, w.cols)).astype(np.float32)
    alone = np.concatenate([_matmul(x[i : i + 1], w, path) for i in range(40)])
    assert np.allclose(alone, x @ quant.dequantize_all(w).T, rtol=1e-4, atol=1e-4)
    for batch in (2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 15, 16, 17, 32, 33, 40):
        assert np.array_equal(_matmul(x[:batch], w, path), alone[:batch])
        shifted = _matmul(x[40 - batch :], w, path)  # the same rows at other places
        assert np.array_equal(shifted, alone[40 - batch :])


@pytest.mark.skipif("avx2" not in PATHS, reason="the native kernels are not built")
def test_native_tile_widths_give_the_same_bits(matrix: quant.QuantMatrix) -> None:
    x = np.random.default_rng(3).standard_normal((32, matrix.cols)).astype(np.float32)
    for batch in (1, 4, 7, 32):
        assert np.array_equal(
            _matmul(x[:batch], matrix, "avx2"), _matmul(x[:batch], matrix, "best")
        )
