"""A K-quant encoder for tests: gguf-py decodes Q2_K .. Q6_K but cannot encode them.

``quantize(data, qtype)`` writes float32 rows as GGUF blocks with a simple choice of
scales (each sub-block's min/max or largest magnitude, the scales themselves quantized
against the super-block's largest): no error search like llama.cpp's, but the block
*format* is exact, so ``gguf.quants.dequantize`` and the kernels read what a real file
holds.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

QK_K = 256
F16 = np.float16


def quantize(data: np.ndarray, qtype: QT) -> np.ndarray:
    """Rows of float32 [rows, cols] (cols a multiple of 256) as uint8 [rows, bytes]."""
    data = np.asarray(data, dtype=np.float32)
    rows, cols = data.shape
    if cols % QK_K:
        raise ValueError(f"K-quant rows need a multiple of {QK_K} weights, not {cols}")
    blocks = data.reshape(-1, QK_K)
    encode = {
        QT.Q2_K: _q2_k,
        QT.Q3_K: _q3_k,
        QT.Q4_K: _q4_k,
        QT.Q5_K: _q5_k,
        QT.Q6_K: _q6_k,
    }[qtype]
    return encode(blocks).reshape(rows, -1)


def _half(x: np.ndarray) -> np.ndarray:
    """Float16 values [n] as bytes [n, 2]."""
    return np.asarray(x, F16).reshape(-1, 1).view(np.uint8)


def _scale_of(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block, a float16 scale ``d`` and integers 0..levels with values ~ d * q."""
    top = values.max(axis=-1)
    d = (top / levels).astype(F16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, None] > 0, np.rint(values / d[:, None]), 0)
    return d, np.clip(q, 0, levels).astype(np.uint8)


def _asymmetric(
    blocks: np.ndarray, sub: int, levels: int, scale_levels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sub-blocks of ``sub`` as w ~ (d sc) q - (dmin m), q in 0..levels: d, dmin, sc, m, q."""
    n = blocks.shape[0]
    parts = blocks.reshape(n, -1, sub)
    low = np.minimum(parts.min(axis=-1), 0.0)
    scale = (parts.max(axis=-1) - low) / levels
    d, sc = _scale_of(scale, scale_levels)
    dmin, m = _scale_of(-low, scale_levels)
    dl = (d[:, None] * sc)[..., None]
    ml = (dmin[:, None] * m)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(dl > 0, np.rint((parts + ml) / dl), 0)
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(n, QK_K)
    return d, dmin, sc, m, q


def _symmetric(
    blocks: np.ndarray, sub: int, low: int, high: int, scale_levels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sub-blocks of ``sub`` as w ~ (d sc) q, q in low..high, sc in 0..scale_levels."""
    n = blocks.shape[0]
    parts = blocks.reshape(n, -1, sub)
    scale = np.abs(parts).max(axis=-1) / -low
    d, sc = _scale_of(scale, scale_levels)
    dl = (d[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(dl > 0, np.rint(parts / dl), 0)
    return d, sc, np.clip(q, low, high).astype(np.int16).reshape(n, QK_K)


def _pack_6bit(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 scale bytes from 8 scales and 8 mins of 6 bits each."""
    low_sc, high_sc, low_m, high_m = sc[:, :4], sc[:, 4:], m[:, :4], m[:, 4:]
    first = low_sc | ((high_sc >> 4) << 6)
    second = low_m | ((high_m >> 4) << 6)
    third = (high_sc & 15) | ((high_m & 15) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Weights 64 p + l (low nibble) and 64 p + 32 + l (high) in byte 32 p + l."""
    pairs = q.reshape(-1, 4, 2, 32) & 15
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """Weight 128 h + 32 j + l's two bits at bits 2 j of byte 32 h + l."""
    planes = q.reshape(-1, 2, 4, 32).astype(np.uint8) & 3
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(planes << shifts, axis=2).reshape(-1, 64)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """Weight 32 k + l's bit at bit k of byte l (Q3_K's hmask, Q5_K's qh)."""
    planes = bits.reshape(-1, 8, 32).astype(np.uint8) & 1
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return np.bitwise_or.reduce(planes << shifts, axis=1)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asymmetric(blocks, 32, 15, 63)
    return np.concatenate([_half(d), _half(dmin), _pack_6bit(sc, m), _nibble_pairs(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asymmetric(blocks, 32, 31, 63)
    parts = [_half(d), _half(dmin), _pack_6bit(sc, m), _bit_planes(q >> 4), _nibble_pairs(q)]
    return np.concatenate(parts, axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(blocks, 16, -32, 31, 127)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    ql = (u[:, :, :64] & 15) | ((u[:, :, 64:] & 15) << 4)  # r (low), r + 64 (high)
    high = (u >> 4).reshape(-1, 2, 4, 32)  # r = 32 j + l: bits 2 j of byte l
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = np.bitwise_or.reduce(high << shifts, axis=2)
    scales = sc.astype(np.int8).view(np.uint8)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), scales, _half(d)]
    return np.concatenate(parts, axis=1).astype(np.uint8)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asymmetric(blocks, 16, 3, 15)
    scales = (sc | (m << 4)).astype(np.uint8)
    return np.concatenate([scales, _two_bit_planes(q), _half(d), _half(dmin)], axis=1)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(blocks, 16, -4, 3, 31)
    u = (q + 4).astype(np.uint8)  # 0..7: two low bits in qs, the third in hmask
    stored = (sc.astype(np.int16) + 32).astype(np.uint8)  # 6-bit scales, offset by 32
    low = stored & 15
    nibbles = low[:, :8] | (low[:, 8:] << 4)
    high = (stored >> 4).reshape(-1, 4, 4)  # scale i = 4 s + b: bits 2 s of byte 8 + b
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    tops = np.bitwise_or.reduce(high << shifts, axis=1)
    scales = np.concatenate([nibbles, tops], axis=1)
    parts = [_bit_planes(u >> 2), _two_bit_planes(u), scales, _half(d)]
    return np.concatenate(parts, axis=1).astype(np.uint8)
