"""Q4_K's and Q5_K's 6-bit scales and mins, which the kernels' layouts keep packed as the
file holds them (12 bytes a row and super-block) and unpack per super-block: matrices
whose scales and mins use all six bits, sub-blocks 4-7 at 32-63 (their top two bits in
the bytes shared with sub-blocks 0-3), multiply on every native path as their
gguf-py dequantization does, and the layouts hold exactly the file's bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from meshnet.backends import quant

pytestmark = pytest.mark.skipif(quant.NATIVE is None, reason="the native kernels are not built")

QK_K = 256
BLOCK_BYTES = {QT.Q4_K: 144, QT.Q5_K: 176}


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Per super-block the 12 bytes of 8 scales and 8 mins (0..63), as llama.cpp writes
    them: bytes 0-3 scales 0-3, bytes 4-7 mins 0-3, each with the top two bits of
    sub-block 4-7's in bits 6-7; bytes 8-11 the low nibbles of scales 4-7 and, above
    them, of mins 4-7."""
    low = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6], 1)
    nibbles = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    return np.concatenate([low, nibbles], axis=1).astype(np.uint8)


def _blocks(
    qtype: QT, supers: int, seed: int, d: float | None = None, dmin: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``supers`` GGUF super-blocks of random quants whose scales and mins take every
    6-bit value: sub-blocks 0-3 at 0..63, 4-7 at 32..63. Also returns the scales and
    mins [supers, 8]. ``d``, ``dmin``: those float16 fields for every block (else
    random)."""
    rng = np.random.default_rng(seed)
    sc = np.concatenate([rng.integers(0, 64, (supers, 4)), rng.integers(32, 64, (supers, 4))], 1)
    m = np.concatenate([rng.integers(0, 64, (supers, 4)), rng.integers(32, 64, (supers, 4))], 1)
    sc[0], m[0] = [63, 0, 31, 32, 32, 63, 47, 48], [0, 63, 32, 31, 63, 32, 48, 47]  # the edges
    raw = rng.integers(0, 256, (supers, BLOCK_BYTES[qtype]), dtype=np.uint8)
    fields = [d, dmin]
    for i, value in enumerate(fields):
        scale = rng.uniform(0.001, 0.02, supers) if value is None else np.full(supers, value)
        raw[:, 2 * i : 2 * i + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw[:, 4:16] = _pack_scales(sc.astype(np.uint8), m.astype(np.uint8))
    return raw, sc, m


@pytest.mark.parametrize("qtype", list(BLOCK_BYTES), ids=lambda q: q.name)
def test_the_tests_packing_is_what_gguf_py_reads(qtype: QT) -> None:
    """Quants all 1 (Q5_K: fifth bits 0), d = 1, dmin = 1/256: each weight is its
    sub-block's sc - m / 256 exactly, so the packing above is the format's."""
    raw, sc, m = _blocks(qtype, 6, seed=1, d=1.0, dmin=1 / 256)
    raw[:, -128:] = 0x11
    if qtype == QT.Q5_K:
        raw[:, 16:48] = 0
    w = gguf.quants.dequantize(raw, qtype).reshape(6, 8, 32)
    assert np.all(w == (sc - m / 256)[..., None])


def _matrix(qtype: QT, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF bytes of a [rows, cols] matrix of such blocks and their gguf-py dequantization."""
    raw, _, _ = _blocks(qtype, rows * cols // QK_K, seed)
    dense = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float64)
    return raw.reshape(-1), dense


def _exact_q8k_input(tokens: int, cols: int, seed: int) -> np.ndarray:
    """Rows that 8-bit activations (Q8_K: d = max / -127 per 256) hold exactly: integers
    -127..127 times 2^-7, each super-block's largest magnitude 127."""
    k = np.random.default_rng(seed).integers(-127, 128, (tokens, cols))
    k[:, ::QK_K] = 127
    return (k / 128.0).astype(np.float32)


@pytest.mark.parametrize("qtype", list(BLOCK_BYTES), ids=lambda q: q.name)
@pytest.mark.parametrize("q8", [False, True], ids=["fast", "q8"])
@pytest.mark.parametrize("wide", [False, True], ids=["avx2", "widest"])
def test_six_bit_scales_multiply_as_dequantized(qtype: QT, q8: bool, wide: bool) -> None:
    """Every output within float32 rounding of its sum of |w| |x| of float64 math on the
    dequantized weights (the q8 kernels' inputs are held exactly by 8-bit activations),
    for a lone token (its own tiles) and batches; embedding rows are the dequantized
    rows bit for bit."""
    rows, cols = 37, 3 * QK_K  # whole and partial row groups, a part vector
    raw, dense = _matrix(qtype, rows, cols, seed=2)
    w = quant.from_blocks(raw, qtype, (rows, cols), q8=q8)
    assert w.native and w.q8 == q8
    x = _exact_q8k_input(9, cols, seed=3)
    for tokens in (1, 3, 9):
        got = quant.matmul(x[:tokens], w, wide=wide)
        want = x[:tokens].astype(np.float64) @ dense.T
        bound = 1e-5 * (np.abs(x[:tokens]).astype(np.float64) @ np.abs(dense).T)
        assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    ids = np.array([36, 0, 17, 16, 15, 31, 32])
    assert np.array_equal(quant.dequantize_rows(w, ids), dense[ids].astype(np.float32))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("q8", [False, True], ids=["fast", "q8"])
def test_a_k_quant_layout_holds_exactly_the_files_bytes(qtype: QT, q8: bool) -> None:
    """Whole groups of 16 rows take the GGUF's bytes, not one more (the scales and mins
    stay packed; a partial group is padded to 16 rows)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.random.default_rng(4).integers(0, 256, 64 * 2 * size, dtype=np.uint8)
    assert quant.from_blocks(raw, qtype, (64, 2 * QK_K), q8=q8).data.nbytes == raw.nbytes
    part = raw[: 20 * 2 * size]
    assert quant.from_blocks(part, qtype, (20, 2 * QK_K), q8=q8).data.nbytes == 32 * 2 * size
