"""Matrices kept in their GGUF quantized blocks, and the kernels that multiply from them.

A decode step reads ~4.5 bits per weight instead of 32. Every output element
``y[t, r] = W[r] . x[t]`` is computed by the same loop, in the same order,
whatever the number of rows ``t`` in the batch or how rows ``r`` are split
among threads, so a sequence's results are bit-identical alone or batched.
The native kernels (``NATIVE``, built by ``pip install`` where it can) read
``QuantMatrix.packed``, the row groups of ``native/native.h``; the numba kernels
here, their fallback, read ``QuantMatrix.split``:

Split layouts (per matrix row, ``nb = cols / 32`` blocks of 32 weights):
- 4-bit (Q4_0, Q4_1): ``qs`` uint8 [rows, nb * 16], weight ``i < 16`` of a block
  in the low nibble of byte ``i``, weight ``16 + i`` in its high nibble;
  ``w = d * q + m`` with ``m = -8 d`` for Q4_0.
- 8-bit (Q8_0): ``qs`` int8 [rows, nb * 32]; ``w = d * q``.
- float (any other type, dequantized): ``w`` float32 [rows, cols].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import gguf
import numba
import numpy as np
from gguf import GGMLQuantizationType as QT
from numba import prange

from meshnet.model.gguf_file import GGUFFile

F32 = np.float32
QK = 32  # weights per block in every supported block type
_RAW_TYPES = {QT.Q4_0: 0, QT.Q4_1: 1, QT.Q8_0: 2}  # as numbered in native/native.h
_BLOCK_BYTES = (18, 20, 34)  # per GGUF block of each _RAW_TYPES code
GROUP_ROWS = 16  # rows per group of the native kernels' layout

try:  # AVX2 kernels built by `pip install` where a compiler and the CPU allow
    from meshnet.backends import _native as NATIVE
except ImportError:
    NATIVE = None


def kernel_name() -> str:
    """Which kernels multiply quantized blocks in this process."""
    return "avx2" if NATIVE is not None else "numba"


class Split(NamedTuple):
    """A matrix as the numba kernels and row gathers read it."""

    qs: np.ndarray  # quants (q4: uint8 [rows, cols / 2], q8: int8 [rows, cols]) or f32 weights
    d: np.ndarray  # float32 [rows, nb] block scales (empty for f32)
    m: np.ndarray  # float32 [rows, nb] block offsets (q4 only; Q4_0: -8 d)


@dataclass(frozen=True)
class QuantMatrix:
    """A [rows, cols] weight matrix: GGUF blocks (q4, q8) or float32 weights (f32).

    The kernels' layouts are made from ``raw`` on first use, each once: ``packed``
    for the native kernels, ``split`` for the numba ones and row gathers. A matrix
    only the native kernels multiply never holds the other copy.
    """

    kind: str  # "q4", "q8" or "f32"
    rows: int
    cols: int
    raw: np.ndarray  # q4/q8: the GGUF's own blocks (uint8 [rows, bytes]); f32: the weights
    raw_type: int = -1  # _RAW_TYPES code of ``raw`` (q4, q8)

    @cached_property
    def packed(self) -> np.ndarray:
        """``raw`` in the native kernels' row-group layout."""
        if self.kind == "f32":
            raise ValueError("only matrices in GGUF blocks have native kernels")
        return pack_groups(self.raw, self.rows, self.cols // QK, self.raw_type)

    @cached_property
    def split(self) -> Split:
        """``raw`` as quants, float32 scales and offsets."""
        empty = np.empty((0, 0), F32)
        if self.kind == "f32":
            return Split(self.raw, empty, empty)
        nb = self.cols // QK
        blocks = np.asarray(self.raw, np.uint8).reshape(self.rows, nb, _BLOCK_BYTES[self.raw_type])
        d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(F32)
        if self.kind == "q8":
            qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(self.rows, -1)
            return Split(qs, d, empty)
        if self.raw_type == _RAW_TYPES[QT.Q4_1]:
            m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(F32)
        else:
            m = (d * F32(-8.0)).astype(F32)
        qs = np.ascontiguousarray(blocks[:, :, -16:]).reshape(self.rows, -1)
        return Split(qs, d, m)


def from_gguf(f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, int]) -> QuantMatrix:
    """A GGUF 2-D tensor for the kernels: Q4_0, Q4_1 and Q8_0 kept in their own blocks,
    other types dequantized."""
    rows, cols = shape
    raw = np.asarray(t.data)
    qtype = QT(t.tensor_type)
    if qtype in _RAW_TYPES and cols % QK == 0:
        kind = "q8" if qtype == QT.Q8_0 else "q4"
        return QuantMatrix(kind, rows, cols, raw.reshape(rows, -1), _RAW_TYPES[qtype])
    w = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=F32).reshape(rows, cols)
    return QuantMatrix("f32", rows, cols, np.ascontiguousarray(w))


def stack_rows(parts: list[QuantMatrix]) -> QuantMatrix:
    """One matrix of the parts' rows in order (fused Q/K/V or gate/up): one kind, block
    type and width."""
    if len({(p.kind, p.raw_type, p.cols) for p in parts}) != 1:
        raise ValueError("only matrices of one kind, block type and width can be fused")
    first = parts[0]
    return QuantMatrix(
        first.kind,
        sum(p.rows for p in parts),
        first.cols,
        np.concatenate([p.raw for p in parts]),
        first.raw_type,
    )


def dequantize_all(w: QuantMatrix) -> np.ndarray:
    """The whole matrix as float32 [rows, cols] (for many-row matmuls through BLAS)."""
    if w.kind == "f32":
        return w.raw
    return dequantize_rows(w, np.arange(w.rows, dtype=np.int64))


def dequantize_rows(w: QuantMatrix, ids: np.ndarray) -> np.ndarray:
    """Float32 rows ``ids`` of ``w`` (the embedding lookup): [len(ids), cols]."""
    out = np.empty((len(ids), w.cols), F32)
    qs, d, m = w.split
    _gather(w.kind, qs, d, m, np.ascontiguousarray(ids, dtype=np.int64), out)
    return out


def matmul(x: np.ndarray, w: QuantMatrix, native: bool = True, wide: bool = True) -> np.ndarray:
    """``x @ w.T`` for x [T, cols] float32 -> [T, rows] float32.

    ``native=False`` forces the numba kernels even where the AVX2 ones are built;
    ``wide=False`` keeps the native ones to AVX2's 8-row vectors (the same results).
    """
    x = np.ascontiguousarray(x, dtype=F32)
    out = np.empty((x.shape[0], w.rows), F32)
    if native and NATIVE is not None and w.kind != "f32":
        packed, rows, nb, kind = native_args(w)
        threads = numba.get_num_threads()
        NATIVE.matmul(packed, x, out, rows, nb, x.shape[0], kind, threads, wide)
        return out
    qs, d, m = w.split
    if w.kind == "q4":
        _matmul_q4(qs, d, m, x, _block_sums(x), out)
    elif w.kind == "q8":
        _matmul_q8(qs, d, x, out)
    else:
        _matmul_f32(qs, x, out)
    return out


def native_args(w: QuantMatrix) -> tuple[np.ndarray, int, int, int]:
    """``w`` as the native kernels take a matrix: (packed, rows, nb, type)."""
    return w.packed, w.rows, w.cols // QK, w.raw_type


def pack_groups(raw: np.ndarray, rows: int, nb: int, code: int) -> np.ndarray:
    """GGUF blocks [rows, nb] of type ``code`` in the row-group layout of native.h: per
    group of 16 rows (the last padded with zero blocks) and block, the rows' float16
    scales, Q4_1's float16 offsets, then the quants column by column, one byte per row."""
    size = _BLOCK_BYTES[code]
    groups = -(-rows // GROUP_ROWS)
    blocks = np.zeros((groups * GROUP_ROWS, nb, size), np.uint8)
    blocks[:rows] = np.asarray(raw, np.uint8).reshape(rows, nb, size)
    by_group = blocks.reshape(groups, GROUP_ROWS, nb, size).transpose(0, 2, 1, 3)
    halves = 4 if code == 1 else 2  # bytes of float16 fields before the quants
    fields = [by_group[..., h : h + 2].reshape(groups, nb, 2 * GROUP_ROWS) for h in (0, 2)]
    quants = by_group[..., halves:].transpose(0, 1, 3, 2).reshape(groups, nb, -1)
    parts = [*fields[: halves // 2], quants]
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)


@numba.njit(cache=True)
def _block_sums(x: np.ndarray) -> np.ndarray:
    t, k = x.shape
    nb = k // QK
    out = np.empty((t, nb), np.float32)
    for i in range(t):
        for b in range(nb):
            s = np.float32(0.0)
            for j in range(QK):
                s += x[i, b * QK + j]
            out[i, b] = s
    return out


# The kernels keep 32 per-lane partial sums across a row's blocks and add them
# up once at the end: LLVM vectorises the lane loop, and the summation order is
# fixed by the code alone (never by the batch size or the thread count).


@numba.njit(parallel=True, fastmath=True, cache=True)
def _matmul_q4(
    qs: np.ndarray, d: np.ndarray, m: np.ndarray, x: np.ndarray, sx: np.ndarray, out: np.ndarray
) -> None:
    nb = d.shape[1]
    for r in prange(qs.shape[0]):
        qr, dr, mr = qs[r], d[r], m[r]
        acc = np.empty(QK, np.float32)
        for t in range(x.shape[0]):
            xr, sxr = x[t], sx[t]
            acc[:] = 0.0
            offset = np.float32(0.0)
            for b in range(nb):
                q0, x0, db = b * 16, b * QK, dr[b]
                for i in range(16):
                    byte = qr[q0 + i]
                    acc[i] += db * (np.float32(byte & 15) * xr[x0 + i])
                    acc[16 + i] += db * (np.float32(byte >> 4) * xr[x0 + 16 + i])
                offset += mr[b] * sxr[b]
            total = np.float32(0.0)
            for i in range(QK):
                total += acc[i]
            out[t, r] = total + offset


@numba.njit(parallel=True, fastmath=True, cache=True)
def _matmul_q8(qs: np.ndarray, d: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    nb = d.shape[1]
    for r in prange(qs.shape[0]):
        qr, dr = qs[r], d[r]
        acc = np.empty(QK, np.float32)
        for t in range(x.shape[0]):
            xr = x[t]
            acc[:] = 0.0
            for b in range(nb):
                x0, db = b * QK, dr[b]
                for i in range(QK):
                    acc[i] += db * (np.float32(qr[x0 + i]) * xr[x0 + i])
            total = np.float32(0.0)
            for i in range(QK):
                total += acc[i]
            out[t, r] = total


@numba.njit(parallel=True, fastmath=True, cache=True)
def _matmul_f32(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    cols = w.shape[1]
    for r in prange(w.shape[0]):
        wr = w[r]
        acc = np.empty(QK, np.float32)
        for t in range(x.shape[0]):
            xr = x[t]
            acc[:] = 0.0
            for c in range(0, cols - cols % QK, QK):  # whole lanes, then the tail
                for i in range(QK):
                    acc[i] += wr[c + i] * xr[c + i]
            total = np.float32(0.0)
            for i in range(QK):
                total += acc[i]
            for c in range(cols - cols % QK, cols):
                total += wr[c] * xr[c]
            out[t, r] = total


def _gather(
    kind: str, qs: np.ndarray, d: np.ndarray, m: np.ndarray, ids: np.ndarray, out: np.ndarray
) -> None:
    if kind == "q4":
        _gather_q4(qs, d, m, ids, out)
    elif kind == "q8":
        _gather_q8(qs, d, ids, out)
    else:
        out[:] = qs[ids]


@numba.njit(cache=True)
def _gather_q4(
    qs: np.ndarray, d: np.ndarray, m: np.ndarray, ids: np.ndarray, out: np.ndarray
) -> None:
    for n in range(ids.shape[0]):
        r = ids[n]
        for b in range(d.shape[1]):
            for i in range(16):
                byte = qs[r, b * 16 + i]
                out[n, b * QK + i] = d[r, b] * np.float32(byte & 15) + m[r, b]
                out[n, b * QK + 16 + i] = d[r, b] * np.float32(byte >> 4) + m[r, b]


@numba.njit(cache=True)
def _gather_q8(qs: np.ndarray, d: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    for n in range(ids.shape[0]):
        r = ids[n]
        for b in range(d.shape[1]):
            for i in range(QK):
                out[n, b * QK + i] = d[r, b] * np.float32(qs[r, b * QK + i])
