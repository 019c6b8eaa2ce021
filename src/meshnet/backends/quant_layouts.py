"""The native kernels' matrix layouts (``native/native.h``), made once from GGUF blocks.

Q4_0, Q4_1, Q8_0 and the K-quants (Q4_K, Q5_K, Q6_K) are repacked into groups of 16
rows whose fields are stored column by column, one byte (or float16) per row, so a
vector load gives one column of 8 or 16 rows. The other types (Q2_K, Q3_K, Q5_0, Q5_1,
F16, BF16, F32) keep the GGUF's own rows: their kernel unpacks a tile at a time.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

QK = 32  # weights per block; a matrix's width is nb * QK in every type
QK_K = 256  # weights per K-quant super-block
GROUP_ROWS = 16  # rows per group of the row-group layouts

# The native kernels' number for each type they multiply, as in native/native.h.
CODES = {
    QT.Q4_0: 0,
    QT.Q4_1: 1,
    QT.Q8_0: 2,
    QT.Q4_K: 3,
    QT.Q5_K: 4,
    QT.Q6_K: 5,
    QT.Q2_K: 6,
    QT.Q3_K: 7,
    QT.Q5_0: 8,
    QT.Q5_1: 9,
    QT.F16: 10,
    QT.BF16: 11,
    QT.F32: 12,
}
LEGACY = frozenset({QT.Q4_0, QT.Q4_1, QT.Q8_0})  # row groups per block of 32
KQUANTS = frozenset({QT.Q4_K, QT.Q5_K, QT.Q6_K})  # row groups per super-block
SUPER_BLOCKED = frozenset({QT.Q2_K, QT.Q3_K, *KQUANTS})  # widths a multiple of 256


def width_unit(qtype: QT) -> int:
    """The columns a matrix of ``qtype`` must be a whole number of for the kernels."""
    return QK_K if qtype in SUPER_BLOCKED else QK


def pack(raw: np.ndarray, qtype: QT, rows: int, cols: int) -> np.ndarray:
    """GGUF blocks (uint8, ``rows`` rows of ``cols`` weights) in the native layout of
    ``qtype``: a fresh uint8 array for the row-group types, ``raw`` itself (flat) for the
    row-wise ones."""
    raw = np.asarray(raw, np.uint8)
    if qtype in LEGACY:
        return _pack_legacy(raw, qtype, rows, cols // QK)
    if qtype in KQUANTS:
        return _pack_kquant(raw, qtype, rows, cols // QK_K)
    return raw.reshape(-1)


def _by_group(raw: np.ndarray, rows: int, units: int, size: int) -> np.ndarray:
    """Blocks [rows, units, size] as [groups, units, 16 rows, size], padded with zeros."""
    groups = -(-rows // GROUP_ROWS)
    blocks = np.zeros((groups * GROUP_ROWS, units, size), np.uint8)
    blocks[:rows] = raw.reshape(rows, units, size)
    return blocks.reshape(groups, GROUP_ROWS, units, size).transpose(0, 2, 1, 3)


def _columns(fields: np.ndarray) -> np.ndarray:
    """Per-row byte fields [g, u, 16, n] as n columns of 16 rows: [g, u, n * 16]."""
    g, u = fields.shape[:2]
    return fields.transpose(0, 1, 3, 2).reshape(g, u, -1)


def _rows_of(fields: np.ndarray) -> np.ndarray:
    """Per-row fields [g, u, 16, n] row after row: [g, u, 16 * n] (float16 scales)."""
    g, u = fields.shape[:2]
    return fields.reshape(g, u, -1)


def _pack_legacy(raw: np.ndarray, qtype: QT, rows: int, nb: int) -> np.ndarray:
    """Per group and block: the rows' float16 d, Q4_1's float16 m, then the quants column
    by column, one byte per row."""
    size = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q8_0: 34}[qtype]
    by = _by_group(raw, rows, nb, size)
    halves = 4 if qtype == QT.Q4_1 else 2  # bytes of float16 fields before the quants
    parts = [_rows_of(by[..., h : h + 2]) for h in range(0, halves, 2)]
    parts.append(_columns(by[..., halves:]))
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)


def _pack_kquant(raw: np.ndarray, qtype: QT, rows: int, supers: int) -> np.ndarray:
    """Per group and super-block, native.h's K-quant fields: Q4_K/Q5_K d, dmin, the 6-bit
    scales and mins a byte each, (Q5_K) the high bits, the nibbles; Q6_K d, the int8
    scales, the low nibbles, the high bits."""
    size = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}[qtype]
    by = _by_group(raw, rows, supers, size)
    if qtype == QT.Q6_K:
        parts = [
            _rows_of(by[..., 208:210]),
            _columns(by[..., 192:208]),
            _columns(by[..., 0:128]),
            _columns(by[..., 128:192]),
        ]
    else:
        scales, mins = _scales_mins(by[..., 4:16])
        parts = [_rows_of(by[..., 0:2]), _rows_of(by[..., 2:4]), _columns(scales)]
        parts.append(_columns(mins))
        if qtype == QT.Q5_K:
            parts.append(_columns(by[..., 16:48]))
        parts.append(_columns(by[..., -128:]))
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)


def _scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins [..., 12] as [..., 8] bytes each:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the
    nibbles of bytes 8-11, their top two bits in the top bits of bytes 0-3 and 4-7."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mins = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return scales.astype(np.uint8), mins.astype(np.uint8)
