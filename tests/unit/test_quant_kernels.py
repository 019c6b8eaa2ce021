"""Every block type on every kernel path (numba always; the native kernels with AVX2's
8-row vectors and at their widest, 16 rows with AVX-512, where built) against
dequantized math, and bit-identical for a row alone or anywhere in a batch, whatever
the thread count; the two native widths agree bit for bit; embedding rows are gguf-py's
dequantized rows."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from kquants import quantize as k_quantize

from meshnet.backends import quant
from meshnet.errors import UnsupportedTensorType
from meshnet.memory import HUGE_PAGE, on_huge_pages
from meshnet.model.gguf_file import open_gguf

NATIVE_BUILT = quant.NATIVE is not None
# numba; the native kernels with AVX2 vectors; the native kernels at their widest
PATHS = ["numba", "avx2", "best"] if NATIVE_BUILT else ["numba"]
K_TYPES = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
TYPES = [QT.Q4_0, QT.Q4_1, QT.Q8_0, *K_TYPES, QT.Q5_0, QT.Q5_1, QT.F16, QT.BF16, QT.F32]
COLS = 512  # two super-blocks


def gguf_bytes(data: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 rows as the bytes a GGUF file holds for ``qtype``."""
    data = np.asarray(data, np.float32)
    if qtype == QT.F32:
        return data.view(np.uint8)
    if qtype == QT.F16:
        return data.astype(np.float16).view(np.uint8)
    if qtype in K_TYPES:
        return k_quantize(data, qtype)
    return gguf.quants.quantize(data, qtype)


def _matrix(
    qtype: QT, rows: int, path: str, seed: int = 0, cols: int = COLS
) -> tuple[quant.QuantMatrix, np.ndarray]:
    """A random matrix of ``qtype`` for ``path`` and its gguf-py dequantization."""
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.2
    raw = gguf_bytes(data, qtype)
    w = quant.from_blocks(raw, qtype, (rows, cols), native=path != "numba")
    return w, gguf.quants.dequantize(raw, qtype).reshape(rows, cols)


def _matmul(x: np.ndarray, w: quant.QuantMatrix, path: str) -> np.ndarray:
    return quant.matmul(x, w, wide=path == "best")


@pytest.fixture(scope="module", params=TYPES, ids=lambda q: q.name)
def qtype(request) -> QT:  # type: ignore[no-untyped-def]
    return request.param


@pytest.mark.parametrize("path", PATHS)
def test_kernels_match_dequantized_math(qtype: QT, path: str) -> None:
    """Within float32 rounding of each output's sum of |w| |x|."""
    w, dense = _matrix(qtype, 40, path)
    x = np.random.default_rng(0).standard_normal((9, COLS)).astype(np.float32)
    exact = x.astype(np.float64) @ dense.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(dense).T.astype(np.float64)
    assert np.all(np.abs(_matmul(x, w, path) - exact) <= 1e-5 * scale)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [61, 7])  # whole and partial row groups, a part vector
def test_every_tile_shape_gives_a_row_the_same_bits(qtype: QT, path: str, rows: int) -> None:
    """Batches the kernels split into register tiles of every width (and partial row
    groups) give each token exactly what it gets alone, at any place in the batch."""
    w, _ = _matrix(qtype, rows, path, seed=rows)
    x = np.random.default_rng(2).standard_normal((40, COLS)).astype(np.float32)
    alone = np.concatenate([_matmul(x[i : i + 1], w, path) for i in range(40)])
    for batch in (2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 15, 16, 17, 32, 33, 40):
        assert np.array_equal(_matmul(x[:batch], w, path), alone[:batch])
        shifted = _matmul(x[40 - batch :], w, path)  # the same rows at other places
        assert np.array_equal(shifted, alone[40 - batch :])


@pytest.mark.skipif(not NATIVE_BUILT, reason="the native kernels are not built")
@pytest.mark.parametrize("blocky", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q5_1])
def test_wide_rows_in_large_batches_give_a_row_the_same_bits(blocky: QT) -> None:
    """Rows of more blocks than AVX2's large batches unpack at a time (64): each token
    gets what it gets alone, at either vector width and thread count."""
    w, dense = _matrix(blocky, 37, "best", seed=5, cols=32 * 70)
    x = np.random.default_rng(5).standard_normal((20, w.cols)).astype(np.float32)
    alone = np.concatenate([quant.matmul(x[i : i + 1], w, wide=False) for i in range(20)])
    packed, rows, nb, code = quant.native_args(w)
    for threads in (1, 2):
        for wide in (False, True):
            out = np.empty((20, rows), np.float32)
            quant.NATIVE.matmul(packed, x, out, rows, nb, 20, code, threads, wide)
            assert np.array_equal(out, alone)
    exact = x.astype(np.float64) @ dense.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(dense).T.astype(np.float64)
    assert np.all(np.abs(alone - exact) <= 1e-5 * scale)


@pytest.mark.skipif(not NATIVE_BUILT, reason="the native kernels are not built")
def test_native_widths_and_thread_counts_give_the_same_bits(qtype: QT) -> None:
    w, _ = _matrix(qtype, 93, "best", seed=3)
    packed, rows, nb, code = quant.native_args(w)
    x = np.random.default_rng(3).standard_normal((32, COLS)).astype(np.float32)
    for batch in (1, 4, 7, 32):
        outs = []
        for threads in (1, 2):
            for wide in (False, True):
                out = np.empty((batch, rows), np.float32)
                quant.NATIVE.matmul(packed, x[:batch], out, rows, nb, batch, code, threads, wide)
                outs.append(out)
        assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("path", PATHS[:2])
def test_rows_are_gguf_dequantized_rows(qtype: QT, path: str) -> None:
    w, dense = _matrix(qtype, 37, path, seed=4)
    ids = np.array([36, 0, 17, 17, 16, 15, 31, 32])
    assert np.array_equal(quant.dequantize_rows(w, ids), dense[ids])
    assert np.array_equal(quant.dequantize_all(w), dense)


@pytest.mark.skipif(not NATIVE_BUILT, reason="the native kernels are not built")
@pytest.mark.parametrize(
    "grouped",
    [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K],
    ids=lambda q: q.name,
)
def test_a_native_matrix_holds_about_its_gguf_bytes(grouped: QT) -> None:
    """The row-group layouts repack the blocks, within 3% of the GGUF's bytes for whole
    groups of rows; the GGUF bytes they came from are not kept."""
    data = np.random.default_rng(6).standard_normal((64, COLS)).astype(np.float32)
    raw = gguf_bytes(data, grouped)
    w = quant.from_blocks(raw, grouped, (64, COLS))
    assert raw.nbytes <= w.data.nbytes <= 1.03 * raw.nbytes
    assert not np.shares_memory(w.data, raw)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages: Linux")
def test_a_large_native_matrix_lies_on_whole_huge_pages() -> None:
    """A matrix of 2 MB and more is copied to memory starting on a 2 MB boundary (where the
    kernel may map it with huge pages), bytes and shape unchanged; a smaller one stays."""
    big = np.random.default_rng(8).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    placed = on_huge_pages(big)
    assert placed.ctypes.data % HUGE_PAGE == 0
    assert placed.dtype == big.dtype and placed.shape == big.shape
    assert np.array_equal(placed, big) and not np.shares_memory(placed, big)
    small = big[:4096]
    assert on_huge_pages(small) is small


@pytest.mark.parametrize("native", [False, True] if NATIVE_BUILT else [False])
@pytest.mark.parametrize(
    ("qtype", "cols"), [(QT.Q4_K, 128), (QT.Q6_K, 320), (QT.Q2_K, 64), (QT.Q4_0, 48)]
)
def test_a_width_the_type_cannot_fill_is_refused(qtype: QT, cols: int, native: bool) -> None:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros(4 * cols * size // min(block, cols), np.uint8)
    with pytest.raises(UnsupportedTensorType):
        quant.from_blocks(raw, qtype, (4, cols), native=native)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0], ids=lambda q: q.name)
def test_from_gguf_reads_the_files_tensor(tiny_factory, qtype: QT) -> None:  # type: ignore[no-untyped-def]
    f = open_gguf(tiny_factory(f"k{qtype.name}.gguf", matrix_type=qtype))
    t = f.tensors["blk.0.ffn_down.weight"]
    w = quant.from_gguf(f, t, (64, 128))
    assert w.kind == qtype.name.lower() and w.native == NATIVE_BUILT
    dense = gguf.quants.dequantize(np.asarray(t.data), qtype).reshape(64, 128)
    assert np.array_equal(quant.dequantize_all(w), dense)


@pytest.mark.parametrize("path", PATHS[:2])
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.F32], ids=lambda q: q.name)
def test_stacked_rows_multiply_as_their_parts(qtype: QT, path: str) -> None:
    parts = [_matrix(qtype, rows, path, seed=rows)[0] for rows in (32, 16, 13)]
    fused = quant.stack_rows(parts)
    x = np.random.default_rng(5).standard_normal((3, COLS)).astype(np.float32)
    separate = np.concatenate([quant.matmul(x, p) for p in parts], axis=1)
    assert np.array_equal(quant.matmul(x, fused), separate)


def test_only_one_block_type_is_stacked() -> None:
    parts = [_matrix(QT.Q4_K, 16, "best")[0], _matrix(QT.Q6_K, 16, "best")[0]]
    with pytest.raises(ValueError):
        quant.stack_rows(parts)


def _kernel_name_in_a_process(isa: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MESHNET_ISA"}
    if isa is not None:
        env["MESHNET_ISA"] = isa
    code = "from meshnet.backends import quant; print(quant.kernel_name())"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.skipif(not NATIVE_BUILT, reason="the native kernels are not built")
def test_kernel_name_says_which_vectors_run_and_meshnet_isa_chooses_them() -> None:
    widest = "avx512" if _cpu_flags() >= {"avx512f", "avx512vl", "avx512dq", "avx512bw"} else "avx2"
    assert quant.kernel_name() in ("avx2", "avx512")
    assert _kernel_name_in_a_process(None).stdout.strip() == widest
    assert _kernel_name_in_a_process("auto").stdout.strip() == widest
    assert _kernel_name_in_a_process("avx2").stdout.strip() == "avx2"
    wanted = _kernel_name_in_a_process("avx512")
    if widest == "avx512":
        assert wanted.stdout.strip() == "avx512"
    else:  # a CPU without AVX-512 cannot be asked for it
        assert wanted.returncode != 0 and "MESHNET_ISA" in wanted.stderr
    typo = _kernel_name_in_a_process("avx3")
    assert typo.returncode != 0 and "MESHNET_ISA=avx3" in typo.stderr


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())
