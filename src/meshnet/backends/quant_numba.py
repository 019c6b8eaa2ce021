"""The numba kernels: the quantized matmul where the native extension is not built.

Every output element ``y[t, r] = W[r] . x[t]`` is computed by the same loop, in the
same order, whatever the number of rows ``t`` in the batch or how rows ``r`` are split
among threads, so a sequence's results are bit-identical alone or batched. Q4_0, Q4_1
and Q8_0 are read from their blocks split into quants and float32 scales
(``QuantMatrix.split``); every other type is dequantized a chunk of rows at a time and
multiplied as float32 (``matmul_f32``).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

QK = 32

# The kernels keep 32 per-lane partial sums across a row's blocks and add them
# up once at the end: LLVM vectorises the lane loop, and the summation order is
# fixed by the code alone (never by the batch size or the thread count).


@numba.njit(cache=True)
def block_sums(x: np.ndarray) -> np.ndarray:
    """Per token, the sums of x over each block of 32 (the 4-bit offsets multiply them)."""
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


@numba.njit(parallel=True, fastmath=True, cache=True)
def matmul_q4(
    qs: np.ndarray, d: np.ndarray, m: np.ndarray, x: np.ndarray, sx: np.ndarray, out: np.ndarray
) -> None:
    """out = x @ W.T, W 4-bit: byte i of a block holds weights i (low) and 16 + i."""
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
def matmul_q8(qs: np.ndarray, d: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out = x @ W.T, W int8 quants with a float32 scale per block."""
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
def matmul_f32(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out = x @ w.T for float32 w [rows, cols]."""
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
